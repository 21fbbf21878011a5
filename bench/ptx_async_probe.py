"""Whether NVIDIA's OpenCL compiles and runs the PTX a local-memory pipeline needs: cp.async
(global -> local, 16 bytes, with the L2 fetch hint and the zero-filling source size) and
ldmatrix (8x8 b16 fragments from local memory), each given the 32-bit local address of a
__local pointer. The next step for the tensor-core kernels (ci/results/h100_decode_loads.txt:
the decode is bound by the bytes its warps can hold in flight in registers). One line per
check, OK or what went wrong::

    python3 -m bench.ptx_async_probe
"""

from __future__ import annotations

import numpy as np

CP_ASYNC = {
    "cp.async.ca, 32-bit address": 'uint sa = (uint)(ulong)(buf + lid); asm volatile('
    '"cp.async.ca.shared.global [%0], [%1], 16;" :: "r"(sa), "l"(src + lid) : "memory");',
    "cp.async.ca, 64-bit address": 'asm volatile("cp.async.ca.shared.global [%0], [%1], 16;"'
    ' :: "l"(buf + lid), "l"(src + lid) : "memory");',
    "cp.async.cg.L2::256B": 'uint sa = (uint)(ulong)(buf + lid); asm volatile('
    '"cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" :: "r"(sa), "l"(src + lid) : '
    '"memory");',
    "cp.async.cg, zero fill past 32": 'uint sa = (uint)(ulong)(buf + lid); uint n = lid < 32 ?'
    ' 16u : 0u; asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(sa), '
    '"l"(src + lid), "r"(n) : "memory");',
}
CP_KERNEL = """
__kernel void t(__global const uint4* src, __global uint4* dst) {
  __local uint4 buf[64];
  const uint lid = get_local_id(0);
  buf[lid] = (uint4)(0xdeadbeefu);
  barrier(CLK_LOCAL_MEM_FENCE);
  %s
  asm volatile("cp.async.commit_group;" ::: "memory");
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  barrier(CLK_LOCAL_MEM_FENCE);
  dst[lid] = buf[63 - lid];
}"""
# Lane l gives the address of row l % 8 of matrix l / 8 (16-byte rows, 16-byte aligned: an
# unaligned row faults with CL_OUT_OF_RESOURCES); register m of lane l holds matrix m's row
# l / 4, columns 2 (l % 4) and 2 (l % 4) + 1.
LDMATRIX_KERNEL = """
__kernel void t(__global const uint* src, __global uint* dst) {
  __local ushort buf[256] __attribute__((aligned(16)));
  const uint lid = get_local_id(0);
  for (uint i = lid; i < 256; i += 32) buf[i] = (ushort)src[i];
  barrier(CLK_LOCAL_MEM_FENCE);
  uint sa = (uint)(ulong)(buf + 8 * lid), r0, r1, r2, r3;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(sa));
  dst[4 * lid] = r0; dst[4 * lid + 1] = r1; dst[4 * lid + 2] = r2; dst[4 * lid + 3] = r3;
}"""


def _run(ctx: object, q: object, code: str, host: np.ndarray, n_out: int,
         gsize: int) -> np.ndarray:
    import pyopencl as cl
    prg = cl.Program(ctx, code).build()
    a = cl.Buffer(ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=host)
    o = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, n_out * 4)
    cl.Kernel(prg, "t")(q, (gsize,), (gsize,), a, o)
    got = np.empty(n_out, np.uint32)
    cl.enqueue_copy(q, got, o)
    q.finish()
    return got


def main() -> None:
    import pyopencl as cl
    plats = [p for p in cl.get_platforms() if "NVIDIA" in p.name]
    if not plats:
        print("no NVIDIA OpenCL platform")
        return
    ctx = cl.Context([plats[0].get_devices()[0]])
    q = cl.CommandQueue(ctx)
    host = np.arange(256, dtype=np.uint32)
    for name, body in CP_ASYNC.items():
        want = host.reshape(64, 4)[::-1].copy()
        if "zero fill" in name:
            want[:32] = 0
        try:
            got = _run(ctx, q, CP_KERNEL % body, host, 256, 64)
            print(name, "OK" if (got == want.reshape(-1)).all() else f"WRONG {got[:8]}")
        except Exception as exc:    # a compiler or runtime refusal is the answer, reported
            print(name, "ERROR", str(exc)[:300])
    want = np.array([(lo | ((lo + 1) << 16)) for lane in range(32) for m in range(4)
                     for lo in [64 * m + 8 * (lane // 4) + 2 * (lane % 4)]], np.uint32)
    try:
        got = _run(ctx, q, LDMATRIX_KERNEL, host, 128, 32)
        print("ldmatrix.x4", "OK" if (got == want).all() else f"WRONG {got[:8]}")
    except Exception as exc:
        print("ldmatrix.x4", "ERROR", str(exc)[:300])


if __name__ == "__main__":
    main()
