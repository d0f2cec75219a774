"""ops.backend.OpGroup: copies of the same code of an op module define each op once per process; groups whose
schemas or code differ never share an op, so torch.compile's caches, which key a graph on the op names, never serve a
graph compiled against another version's fakes (docs/design.md §8)."""

import os
import subprocess
import sys
import uuid

import pytest
import torch

from hf_densessm.ops.backend import OpGroup


def copy_of_module(namespace, offset, extra_arg=False, extra_op=False):
    """What one copy of an op module defines: ``add`` (x + offset, autograd: gradient ``offset``) and ``twice``
    (which calls the group's ``add``); ``extra_arg`` changes ``add``'s schema, ``extra_op`` adds an op."""
    group = OpGroup(namespace)

    if extra_arg:
        @group.custom_op("add", fake=lambda x, scale=1.0: torch.empty_like(x))
        def add(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            return x + offset
    else:
        @group.custom_op("add", fake=lambda x: torch.empty_like(x))
        def add(x: torch.Tensor) -> torch.Tensor:
            return x + offset

    @group.triton_op("twice")
    def twice(x: torch.Tensor) -> torch.Tensor:
        return group.add(group.add(x))

    group.register_autograd("add", lambda ctx, grad: (grad * offset,) + (None,) * extra_arg,
                            setup_context=lambda ctx, inputs, output: None)
    if extra_op:
        @group.custom_op("negate", fake=lambda x: torch.empty_like(x))
        def negate(x: torch.Tensor) -> torch.Tensor:
            return -x
    group.define()
    return group


def test_copies_share_one_set_of_ops_and_other_schemas_never_share():
    namespace = f"hf_densessm_test_{uuid.uuid4().hex[:8]}"
    x = torch.zeros(3, requires_grad=True)
    first = copy_of_module(namespace, 1.0)
    suffix = first.add._qualified_op_name.rpartition("_")[2]
    assert len(suffix) == 8 and first.twice is getattr(getattr(torch.ops, namespace), f"twice_{suffix}")
    same = copy_of_module(namespace, 10.0)  # same schemas: nothing registered again, the first copy's ops serve
    assert same.add is first.add and same.twice is first.twice
    torch.testing.assert_close(same.twice(x), torch.full((3,), 2.0))
    same.add(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(3))  # the first copy's autograd formula

    newer = copy_of_module(namespace, 100.0, extra_arg=True)  # another schema of `add`: the whole group is its own
    assert newer.add is not first.add and newer.twice is not first.twice
    newer_suffix = newer.add._qualified_op_name.rpartition("_")[2]
    assert newer_suffix != suffix and newer.twice._qualified_op_name == f"{namespace}::twice_{newer_suffix}"
    torch.testing.assert_close(newer.twice(x), torch.full((3,), 200.0))
    torch.testing.assert_close(first.twice(x), torch.full((3,), 2.0))  # the first copy's ops are untouched
    assert copy_of_module(namespace, 5.0, extra_arg=True).twice is newer.twice  # a copy of the newer version shares

    bigger = copy_of_module(namespace, 7.0, extra_op=True)  # a group with one op more shares none of the others'
    assert {bigger.add, bigger.twice}.isdisjoint({first.add, first.twice, newer.add, newer.twice})
    torch.testing.assert_close(bigger.negate(torch.ones(2)), -torch.ones(2))


def test_an_op_is_available_only_after_define():
    group = OpGroup(f"hf_densessm_test_{uuid.uuid4().hex[:8]}")
    group.custom_op("identity", lambda x: x.clone())
    with pytest.raises(AttributeError, match="identity"):
        group.identity


OP_MODULE = '''
import torch
from hf_densessm.ops.backend import OpGroup

group = OpGroup("hf_densessm_test_cache")
TRANSPOSED = {transposed}


def _like(x):
    return x.new_empty(x.shape[1], x.shape[0]).t() if TRANSPOSED else torch.empty_like(x)


@group.custom_op("double", fake=_like)
def double(x: torch.Tensor) -> torch.Tensor:
    return _like(x).copy_(x * 2)


group.define()
'''

COMPILE_SCRIPT = '''
import torch
import op_module
x = torch.arange(12.0).reshape(4, 3)
out = torch.compile(lambda x: op_module.group.double(x) + 1)(x)
torch.testing.assert_close(out, x * 2 + 1)
'''


def test_a_graph_compiled_against_another_versions_fake_is_not_served(tmp_path):
    """Two versions of one op module, the second's fake (and op) returning another layout, compiled one after the
    other in new processes sharing Inductor's cache folder: the second compiles its own graph (the op names differ)
    where a cached graph of the first would fail its stride assertion on the second's output."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    for transposed in (False, True):
        (tmp_path / "op_module.py").write_text(OP_MODULE.format(transposed=transposed))
        result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], cwd=tmp_path, env=env, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, (transposed, result.stderr[-3000:])
