"""OpenCL platform/device probing into DeviceCaps. Never raises: a failure becomes an
unavailable entry with the reason, so `attnreg devices` always lists something."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from attnreg import cache
from attnreg.caps import DeviceCaps, normalize_vendor, unavailable
from attnreg.errors import SpecError

from . import compiler_check, mma_probe, program
from .tiles import NV_SHUFFLE

NAME = "opencl"                   # the backend's name (caps.backend, kernel ids)
# Extensions that decide variants; every extension is listed as a feature anyway.
SUBGROUP_EXTENSIONS = ("cl_khr_subgroups", "cl_intel_subgroups")
# The sub-group kernels map 32 values onto 32 lanes: the driver must run sub-groups of 32 at
# the work-group sizes they use, built as they are (PoCL 5.0's are the whole work-group, 128
# at 128, even under intel_reqd_sub_group_size(32)).
SG_WIDTH = 32
SG_WG = (64, 128, 256)
SG_KERNEL = "{attr} __kernel void sg_width(__global uint* x) {{ x[0] = get_sub_group_size(); }}"
SG_CACHE = "cl_subgroups-v2.json"     # measurements only (v1 stored the verdict)


class SubgroupSizes(BaseModel):
    """The sub-group sizes the driver reported (one per SG_WG), or why it could not say."""

    model_config = ConfigDict(extra="forbid", strict=True)

    sizes: list[Annotated[int, Field(ge=0, le=1 << 16)]] | None = None
    failure: Annotated[str, Field(max_length=300)] | None = None


def subgroup_widths(cl: Any, dev: Any, exts: frozenset[str]) -> dict[str, Any]:
    """The sub-group size the driver reports for the sub-group kernels' work-group sizes,
    for a kernel built with their sub-group size requirement."""
    return subgroup_decide(subgroup_sizes(cl, dev, exts))


def subgroup_decide(m: SubgroupSizes) -> dict[str, Any]:
    """{"ok", "why"} of a measurement."""
    if m.sizes is None:
        return {"ok": False, "why": f"sub-group size query failed: {m.failure}"}
    return subgroup_verdict(m.sizes)


def subgroup_sizes(cl: Any, dev: Any, exts: frozenset[str]) -> SubgroupSizes:
    """Ask the driver (a kernel built with the sub-group kernels' size requirement)."""
    import warnings
    pragma = "#pragma OPENCL EXTENSION cl_khr_subgroups : enable\n" \
        if "cl_khr_subgroups" in exts else ""
    attr = f"__attribute__((intel_reqd_sub_group_size({SG_WIDTH})))" \
        if "cl_intel_required_subgroup_size" in exts else ""
    try:
        ctx = cl.Context([dev])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prog = cl.Program(ctx, pragma + SG_KERNEL.format(attr=attr)).build()
        k = cl.Kernel(prog, "sg_width")
        info = cl.kernel_sub_group_info.MAX_SUB_GROUP_SIZE_FOR_NDRANGE
        sizes = [int(k.get_sub_group_info(dev, info, (wg,))) for wg in SG_WG]
    except Exception as exc:
        return SubgroupSizes(failure=f"{type(exc).__name__}: {str(exc).strip()[:200]}")
    return SubgroupSizes(sizes=sizes)


def subgroup_verdict(sizes: list[int]) -> dict[str, Any]:
    """Whether the sub-group kernels may use the driver's sub-groups of these sizes (one per
    work-group size of SG_WG)."""
    ok = set(sizes) == {SG_WIDTH}
    return {"ok": ok, "why": f"sub-group sizes {sizes} at work-groups {list(SG_WG)}"
            + ("" if ok else f": not {SG_WIDTH}-wide, so the sub-group kernels run emulated")}


def _get(dev: Any, name: str, default: Any = None) -> Any:
    """A device attribute, or default where the driver does not know the query."""
    try:
        return getattr(dev, name)
    except Exception:
        return default


def _device_type(cl: Any, dev: Any) -> Literal["gpu", "cpu", "other"]:
    t = _get(dev, "type", 0)
    if t & cl.device_type.GPU:
        return "gpu"
    if t & cl.device_type.CPU:
        return "cpu"
    return "other"


def _vendor(platform: Any, dev: Any, dtype: str) -> str:
    # PoCL's CPU device reports the host CPU's vendor (and Intel's PCI id even on AMD
    # hosts); what decides tuning there is the implementation, so name PoCL.
    if "portable computing language" in platform.name.lower() and dtype == "cpu":
        return "pocl"
    vid = _get(dev, "vendor_id")
    return normalize_vendor(_get(dev, "vendor", ""), platform.vendor, platform.name,
                            f"0x{vid:04x}" if isinstance(vid, int) else "")


def device_caps(cl: Any, pi: int, di: int, platform: Any, dev: Any,
                env_options: tuple[str, ...] = ()) -> DeviceCaps:
    """One device's capabilities in attnreg's vocabulary; ``env_options`` are the build
    options of ATTNREG_OPENCL_BUILD_OPTIONS (every program gets them; its settings say so)."""
    exts = frozenset(str(_get(dev, "extensions", "")).split())
    dtype = _device_type(cl, dev)
    vendor = _vendor(platform, dev, dtype)
    features = set(exts) | {"profiling"}
    sg_min = sg_max = 0
    arch = ""
    if vendor == "nvidia" and "nvidia" in platform.name.lower():
        warp = _get(dev, "warp_size_nv", 32) or 32
        major, minor = _get(dev, "compute_capability_major_nv"), _get(dev, "compute_capability_minor_nv")
        if major is not None:
            arch = f"sm_{major}{minor}"
        features.add(NV_SHUFFLE)
        sg_min = sg_max = int(warp)
    intel_sizes = _get(dev, "sub_group_sizes_intel") if "cl_intel_subgroups" in exts else None
    if intel_sizes:
        sg_min, sg_max = int(min(intel_sizes)), int(max(intel_sizes))
    mma_ok, mma_why = mma_probe.check(cl, dev, platform, arch)
    build_fix, optimizer = compiler_check.check(cl, dev, platform)
    if mma_ok:
        features.add(mma_probe.FEATURE)
    settings: list[str] = []
    if build_fix:
        settings.append(f"build options {' '.join(build_fix)} on every program: {optimizer}")
    if env_options:
        settings.append(f"build options {' '.join(env_options)} on every program: from "
                        f"{program.EXTRA_ENV}")
    widths = ""
    if NV_SHUFFLE not in features and any(e in exts for e in SUBGROUP_EXTENSIONS):
        key = f"{dev.name}|{dev.driver_version}|{platform.version}"
        measured, _ = cache.verdict(SG_CACHE, key, SubgroupSizes,
                                    lambda: subgroup_sizes(cl, dev, exts))
        got = subgroup_decide(measured)
        widths = str(got["why"])
        if not got["ok"]:                  # the extensions decide no variant (still listed)
            exts = exts - frozenset(SUBGROUP_EXTENSIONS)
            settings.append(widths)
    if any(e in exts for e in SUBGROUP_EXTENSIONS) or NV_SHUFFLE in features:
        features.add("subgroups")
    alloc = int(_get(dev, "max_mem_alloc_size", 0) or 0)
    sizes = _get(dev, "max_work_item_sizes", None) or [0]
    limits = {
        "workgroup_storage": int(_get(dev, "local_mem_size", 0) or 0),
        "invocations": int(_get(dev, "max_work_group_size", 0) or 0),
        "workgroup_size_x": int(sizes[0]),
        "storage_binding": alloc,
        "buffer_size": alloc,
        # Launches are 1-D: the group count in dimension 0 is what is limited.
        "workgroups_per_dim": 2**31 - 1,
    }
    name = " ".join(str(dev.name).split())
    return DeviceCaps(
        backend=NAME, id=f"{NAME}:{pi}:{di}", name=name, vendor=vendor,
        architecture=arch,
        description=f"{platform.name} ({platform.version}); {_get(dev, 'version', '')}",
        driver=str(_get(dev, "driver_version", "")), backend_type="OpenCL", device_type=dtype,
        features=frozenset(features), limits=limits, subgroup_min_size=sg_min,
        subgroup_max_size=sg_max, compute_units=_get(dev, "max_compute_units"),
        settings=tuple(settings),
        extra={"platform": platform.name, "platform_index": pi, "device_index": di,
               "opencl_c_version": str(_get(dev, "opencl_c_version", "")),
               "global_mem_size": int(_get(dev, "global_mem_size", 0) or 0),
               "max_clock_mhz": _get(dev, "max_clock_frequency"),
               "fp16": "cl_khr_fp16" in exts, "ptx_mma": mma_why,
               "cl_optimizer": optimizer, "cl_build_fix": list(build_fix),
               **({"subgroup_widths": widths} if widths else {})})


def probe() -> list[DeviceCaps]:
    """Every device of every OpenCL platform (ids 'opencl:<platform>:<device>')."""
    try:
        import pyopencl as cl
    except Exception as exc:
        return [unavailable(NAME, f"pyopencl not importable: {exc!r}")]
    try:
        platforms = cl.get_platforms()
    except Exception as exc:
        return [unavailable(NAME, f"no OpenCL platform (is an ICD installed?): {exc}")]
    try:
        env_options = program.env_options()
    except SpecError as exc:                  # a malformed variable: its message is the reason
        return [unavailable(NAME, str(exc))]
    out: list[DeviceCaps] = []
    for pi, platform in enumerate(platforms):
        try:
            devices = platform.get_devices()
        except Exception as exc:
            out.append(unavailable(NAME, f"platform {pi} ({platform.name}): {exc}"))
            continue
        for di, dev in enumerate(devices):
            try:
                out.append(device_caps(cl, pi, di, platform, dev, env_options))
            except SpecError as exc:          # a refused cache directory: its message
                out.append(unavailable(NAME, f"device {pi}:{di}: {exc}"))
            except Exception as exc:
                out.append(unavailable(NAME, f"device {pi}:{di}: probe failed: {exc!r}"))
    return out or [unavailable(NAME, "no OpenCL device found")]
