"""Trace each selective-scan op with ``backend="triton"`` on fake CUDA tensors (no GPU needed) and print the Triton
kernels the graph calls: one ``kernels <op> <kernel names>`` line per op. Run by ``test_selective_scan.py`` with
``TRITON_INTERPRET=0`` (under the interpreter ``wrap_triton`` does not wrap kernels, so nothing could be traced).

AOTAutograd (``aot_function``, the stage of ``torch.compile`` that decomposes a ``triton_op`` into its body) traces
each op; the compiler hook reads the graph and stops there (nothing runs: there is no GPU). The kernels' tile
choices use the sm_90 entry of ``ARCHS`` in place of the absent device's properties.
"""

import importlib
import re

import torch
from torch._functorch.aot_autograd import aot_function
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode

from hf_densessm.ops.backend import ARCHS

for _module in ("chunk", "fused_recurrent"):
    importlib.import_module(f"hf_densessm.ops.selective_scan.{_module}").device_arch = lambda device: ARCHS["sm_90"]

from hf_densessm.ops.selective_scan import _ops as scan_ops  # noqa: E402
from hf_densessm.ops.selective_scan import selective_state_update  # noqa: E402


class _Traced(Exception):
    pass


def traced_kernels(fn, *args) -> list[str]:
    """The names of the Triton kernels in the forward graph AOTAutograd traces for ``fn(*args)``."""

    def compiler(gm, example_inputs):
        raise _Traced(gm.code)

    try:
        aot_function(fn, fw_compiler=compiler)(*args)
    except _Traced as traced:
        code = str(traced)
    else:
        raise AssertionError("the compiler hook was not called")
    assert "triton_kernel_wrapper" in code, code
    return [kernel_side_table.get_kernel(int(i)).fn.__name__ for i in re.findall(r"kernel_idx = (\d+)", code)]


def main():
    with FakeTensorMode():
        b, d, n, length = 1, 8, 4, 20

        def t(*shape):
            return torch.randn(*shape, device="cuda")

        reset = torch.zeros(b, length, dtype=torch.bool, device="cuda")
        fwd = [t(b, d, length), t(b, d, length), t(d, n), t(b, n, length), t(b, n, length), t(d), t(b, d, length),
               t(d), True, t(b, d, n), reset]
        kernels = traced_kernels(lambda *a: scan_ops.selective_scan(*a, True, "triton"), *fwd)
        print("kernels selective_scan", *kernels)
        chunk = importlib.import_module("hf_densessm.ops.selective_scan.chunk").selective_scan_config(
            ARCHS["sm_90"], torch.float32, n).chunk
        chunk_states = t(b, -(-length // chunk), d, n)  # ceil(length / chunk) chunks
        kernels = traced_kernels(lambda *a: scan_ops.selective_scan_backward(*a, "triton"),
                                 t(b, d, length), t(b, d, n), *fwd, chunk_states)
        print("kernels selective_scan_backward", *kernels)
        kernels = traced_kernels(lambda s, x, dt, A, B, C: selective_state_update(s, x, dt, A, B, C, backend="triton"),
                                 t(b, d, n), t(b, d), t(b, d), t(d, n), t(b, n), t(b, n))
        print("kernels selective_state_update", *kernels)


if __name__ == "__main__":
    main()
