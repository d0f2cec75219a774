"""ops.backend.OpGroup: copies of an op module (the installed package's, saved folders' remote code, other versions)
define each op once per process; groups whose schemas differ never share an op (docs/design.md §8)."""

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
    assert first.add is getattr(torch.ops, namespace).add and first.twice is getattr(torch.ops, namespace).twice
    same = copy_of_module(namespace, 10.0)  # same schemas: nothing registered again, the first copy's ops serve
    assert same.add is first.add and same.twice is first.twice
    torch.testing.assert_close(same.twice(x), torch.full((3,), 2.0))
    same.add(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(3))  # the first copy's autograd formula

    newer = copy_of_module(namespace, 100.0, extra_arg=True)  # another schema of `add`: the whole group is its own
    assert newer.add is not first.add and newer.twice is not first.twice
    suffix = newer.add._qualified_op_name.rpartition("_")[2]
    assert len(suffix) == 8 and newer.twice._qualified_op_name == f"{namespace}::twice_{suffix}"
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
