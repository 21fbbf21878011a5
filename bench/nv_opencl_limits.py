"""What NVIDIA's OpenCL lets a kernel have, checked on the device (the bounds that
ci/results/h100_prefill_bounds.txt cites for the tensor-core kernels):

1. local memory: the largest __local buffer a work-group launches with (the driver reports
   CL_DEVICE_LOCAL_MEM_SIZE; the SM's own shared memory is larger, but OpenCL has no opt-in);
2. Hopper's asynchronous matrix instructions from OpenCL C: wgmma and setmaxnreg need PTX
   target sm_90a, while the OpenCL compiler emits sm_90, so ptxas refuses them;
3. the same instructions in a PTX program binary whose target was changed to sm_90a (the
   OpenCL C program's own PTX, patched): NVIDIA's OpenCL takes PTX as a binary, so this is a
   route past (2) that a kernel build could take;
4. ``.maxnreg N`` on an entry of such a PTX binary: the register cap OpenCL C cannot express
   (``-cl-nv-maxrregcount`` is accepted and ignored), shown by ptxas' statistics.

One line per check, OK / REFUSED / an error::

    python3 -m bench.nv_opencl_limits
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

FILL = """
__kernel void t(__global int* x, __local int* s, int n) {
  const int l = get_local_id(0);
  for (int i = l; i < n; i += get_local_size(0)) s[i] = i;
  barrier(CLK_LOCAL_MEM_FENCE);
  if (l == 0) x[get_group_id(0)] = s[n - 1];
}"""
# A kernel that stores 1 after the inline PTX (none, or one Hopper instruction).
ASM = '__kernel void t(__global int* x) { %s x[get_global_id(0)] = 1; }'
HOPPER = {"wgmma.fence": "wgmma.fence.sync.aligned;",
          "setmaxnreg.inc": "setmaxnreg.inc.sync.aligned.u32 240;"}
# Enough live values that ptxas wants many registers: a cap shows in its statistics.
HEAVY = """
__kernel void t(__global const float4* a, __global float4* b) {
  const int i = get_global_id(0);
  float4 v[24];
  for (int k = 0; k < 24; ++k) v[k] = a[i * 24 + k];
  float4 acc = (float4)(0.0f);
  for (int r = 0; r < 8; ++r)
    for (int k = 0; k < 24; ++k) acc = fma(v[k], v[(k + r) % 24], acc);
  b[i] = acc;
}"""


def _ptx(prog: Any) -> str:
    import pyopencl as cl
    blob = prog.get_info(cl.program_info.BINARIES)[0]
    return bytes(blob).decode(errors="replace").rstrip("\x00")


def _from_ptx(ctx: Any, dev: Any, ptx: str) -> Any:
    import pyopencl as cl
    return cl.Program(ctx, [dev], [ptx.encode()]).build(options=["-cl-nv-verbose"])


def _regs(prog: Any, dev: Any) -> str:
    import pyopencl as cl
    log = str(prog.get_build_info(dev, cl.program_build_info.LOG))
    return "; ".join(ln.split(":", 1)[-1].strip() for ln in log.splitlines()
                     if "registers" in ln or "spill" in ln)


def local_memory(ctx: Any, dev: Any, q: Any) -> None:
    import pyopencl as cl
    print(f"CL_DEVICE_LOCAL_MEM_SIZE {dev.local_mem_size} B")
    k = cl.Kernel(cl.Program(ctx, FILL).build(), "t")
    buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 16)
    for kib in (40, 47, 48, 64, 96, 160, 227):
        n = kib * 1024 // 4
        try:
            k(q, (512,), (128,), buf, cl.LocalMemory(4 * n), np.int32(n))
            got = np.empty(4, np.int32)
            cl.enqueue_copy(q, got, buf)
            q.finish()
            print(f"__local {kib} KiB", "OK" if (got == n - 1).all() else f"WRONG {got}")
        except Exception as exc:    # the refusal is the answer
            print(f"__local {kib} KiB", "REFUSED", str(exc)[:120])


def hopper_instructions(ctx: Any, dev: Any, q: Any) -> None:
    import pyopencl as cl
    for name, asm in HOPPER.items():
        try:
            cl.Program(ctx, ASM % f'asm volatile("{asm}");').build()
            print(f"OpenCL C {name}", "OK")
        except Exception as exc:
            why = re.search(r"error\s*:\s*([^\n]*)", str(exc))
            print(f"OpenCL C {name}", "REFUSED", why.group(1) if why else str(exc)[:160])
    ptx = _ptx(cl.Program(ctx, ASM % "").build())
    print("OpenCL C's PTX target:", " ".join(re.findall(r"\.target\s+\S+", ptx)))
    patched = ptx.replace(".target sm_90", ".target sm_90a", 1)
    patched, n = re.subn(r"(\n\s*ret;)", "\n\t" + "\n\t".join(HOPPER.values()) + r"\1",
                         patched, count=1)
    try:
        k = cl.Kernel(_from_ptx(ctx, dev, patched), "t")
        buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 128 * 4)
        k(q, (128,), (128,), buf)
        got = np.zeros(128, np.int32)
        cl.enqueue_copy(q, got, buf)
        q.finish()
        print("PTX binary, .target sm_90a, wgmma.fence + setmaxnreg",
              "OK" if n == 1 and (got == 1).all() else f"WRONG {got[:4]}")
    except Exception as exc:
        print("PTX binary, .target sm_90a", "ERROR", str(exc)[:300])


def register_cap(ctx: Any, dev: Any) -> None:
    import pyopencl as cl
    ptx = _ptx(cl.Program(ctx, HEAVY).build())
    print("PTX binary as built:", _regs(_from_ptx(ctx, dev, ptx), dev))
    for cap in (64, 32):
        capped = re.sub(r"(\.entry\s+\w+\s*\([^)]*\))", rf"\1\n.maxnreg {cap}", ptx, count=1)
        print(f"PTX binary with .maxnreg {cap}:", _regs(_from_ptx(ctx, dev, capped), dev))


def main() -> None:
    import pyopencl as cl
    plats = [p for p in cl.get_platforms() if "NVIDIA" in p.name]
    if not plats:
        print("no NVIDIA OpenCL platform")
        return
    dev = plats[0].get_devices()[0]
    ctx = cl.Context([dev])
    q = cl.CommandQueue(ctx)
    print(dev.name, dev.driver_version)
    local_memory(ctx, dev, q)
    hopper_instructions(ctx, dev, q)
    register_cap(ctx, dev)


if __name__ == "__main__":
    main()
