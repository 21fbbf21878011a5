"""AttentionSpec: the one description of an attention problem, validated up front."""

from __future__ import annotations

import math
import numbers
from typing import Annotated, Any, Literal

# bfloat16 arrays are ml_dtypes' (the package made for them); importing it registers the
# dtype name with numpy, so np.dtype("bfloat16") and astype("bfloat16") work everywhere.
import ml_dtypes  # noqa: F401
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from .errors import SpecError

DTYPES = ("float32", "float16", "bfloat16")
# Kernels compute with int32 indices and float32 scalars (docs/contract.md "Non-finite values and
# scalar fields"): integer fields and tensor element counts must fit int32, non-zero float fields
# float32's normal range. Beyond that a kernel would wrap, overflow or flush to zero.
INT_MAX = 2**31 - 1
F32_MAX = 3.4028234663852886e38
F32_TINY = 1.1754943508222875e-38
LAYOUTS = ("BSNH", "BNSH")
KV_LAYOUTS = ("BSNH", "BNSH", "paged")


def _exact_int(value: Any) -> Any:
    # numpy integers are exact, so they are accepted; bool and float are left for the
    # strict validator to reject (True is not a head count, 2.0 is not silently truncated).
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


def _exact_float(value: Any) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Real):
        try:
            return float(value)
        except OverflowError:       # an int past float's range: refused, shown as given
            raise ValueError("a number beyond float range") from None
    return value


Int = Annotated[int, BeforeValidator(_exact_int)]
Float = Annotated[float, BeforeValidator(_exact_float)]

# What each field accepts, in words; used in every SpecError for that field.
EXPECTED: dict[str, str] = {
    "batch": "an integer in [1, 2**31-1]",
    "seq_len": "an integer in [1, 2**31-1] (new query tokens)",
    "past_len": "an integer in [0, 2**31-1] (cached tokens before the new ones)",
    "num_heads": "an integer in [1, 2**31-1]",
    "kv_num_heads": "an integer in [1, 2**31-1] that divides num_heads",
    "head_size": "an integer in [1, 2**31-1]",
    "dtype": "one of 'float32', 'float16', 'bfloat16' (numpy arrays of ml_dtypes.bfloat16)",
    "q_layout": "one of 'BSNH', 'BNSH'",
    "kv_layout": "one of 'BSNH', 'BNSH', 'paged'",
    "page_size": "None, or with kv_layout='paged' an integer in [1, 2**31-1] (keys per page)",
    "num_pages": "None, or with kv_layout='paged' an integer in [1, 2**31-1] (pages in the "
                 "k/v pools)",
    "causal": "a bool",
    "scale": "None (1/sqrt(head_size)) or a float in float32's normal range "
             "[1.1754944e-38, 3.4028235e38]",
    "softcap": "0 (disabled) or a float in float32's normal range [1.1754944e-38, 3.4028235e38]",
    "local_window": "an integer in [-1, 2**31-1] (-1 or 0 disables)",
    "right_window": "an integer in [-1, 2**31-1] (-1 disables; 0 hides every key after the "
                    "query's own position)",
    "alibi_max_bias": "0 (disabled) or a float in float32's normal range "
                      "[1.1754944e-38, 3.4028235e38]",
    "kv_capacity": "None (= total_len) or an integer in [past_len + seq_len, 2**31-1]",
    "bias": "a bool",
    "seqlens_k": "a bool",
    "head_sink": "a bool",
    "return_lse": "a bool",
    "kv_dtype": "None (k, v stored in dtype) or one of 'int8', 'int4' (quantized K/V with "
                "k_scale / v_scale tensors; int4 needs head_size % 32 == 0)",
    "v_head_size": "None (= head_size) or an integer in [1, 2**31-1] (v's and out's last "
                   "dimension)",
    "kv_start": "a bool (a kv_start tensor [B]: keys before kv_start[b] do not exist)",
    "seqlens_q": "a bool (a seqlens_q tensor [B]: batch b has seqlens_q[b] query rows)",
}


class AttentionSpec(BaseModel):
    """What to compute; see docs/contract.md for the exact math of every field.

    Frozen and validated: any bad field raises :class:`attnreg.SpecError` naming it.

    >>> spec = AttentionSpec(batch=1, seq_len=1, past_len=2047, num_heads=32,
    ...                      kv_num_heads=8, head_size=128, dtype="float16")
    >>> spec.total_len, spec.group_size
    (2048, 4)
    """

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid", allow_inf_nan=False)

    batch: Int = Field(1, ge=1, le=INT_MAX)
    seq_len: Int = Field(1, ge=1, le=INT_MAX)
    past_len: Int = Field(0, ge=0, le=INT_MAX)
    num_heads: Int = Field(1, ge=1, le=INT_MAX)
    kv_num_heads: Int = Field(1, ge=1, le=INT_MAX)
    head_size: Int = Field(64, ge=1, le=INT_MAX)
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    q_layout: Literal["BSNH", "BNSH"] = "BSNH"
    kv_layout: Literal["BSNH", "BNSH", "paged"] = "BNSH"
    causal: bool = True
    scale: Float | None = None
    softcap: Float = Field(0.0, ge=0.0)
    local_window: Int = Field(-1, ge=-1, le=INT_MAX)
    alibi_max_bias: Float = Field(0.0, ge=0.0)
    kv_capacity: Int | None = Field(None, le=INT_MAX)
    bias: bool = False
    seqlens_k: bool = False
    head_sink: bool = False
    return_lse: bool = False
    # Quantized K/V (docs/contract.md "Storage dtypes and quantized K/V"): int8 codes with a
    # float32 scale per vector, or int4 q4_0 blocks (uint8 pairs) with a float16 scale per 32.
    kv_dtype: Literal["int8", "int4"] | None = None
    # Paged KV cache (kv_layout="paged"): k/v are page pools [num_pages, page_size, Nkv, H]
    # and a block_table [B, ceil(C / page_size)] int32 maps each sequence's pages.
    page_size: Int | None = Field(None, ge=1, le=INT_MAX)
    num_pages: Int | None = Field(None, ge=1, le=INT_MAX)
    # Shapes real models need (docs/contract.md "Shapes real models need"): v and out with their
    # own head size (Hv); left padding as a per-batch first key (kv_start tensor); per-batch query
    # row counts (seqlens_q tensor: rows past S_b are padding, out 0 and lse -inf).
    v_head_size: Int | None = Field(None, ge=1, le=INT_MAX)
    kv_start: bool = False
    seqlens_q: bool = False
    # Two-sided windows (docs/contract.md "Every head size, two-sided windows"): keys more than
    # right_window positions after a row's position are invisible too (local_window stays the left
    # side); -1 is none, and 0 is meaningful (non-causal, it is exactly causal).
    right_window: Int = Field(-1, ge=-1, le=INT_MAX)

    def __init__(self, **data: Any) -> None:
        unknown = sorted(set(data) - set(type(self).model_fields))
        if unknown:
            raise SpecError(unknown[0], data[unknown[0]],
                            f"one of the AttentionSpec fields {sorted(type(self).model_fields)}")
        try:
            super().__init__(**data)
        except ValidationError as exc:
            err = exc.errors()[0]
            field = str(err["loc"][0]) if err["loc"] else "spec"
            raise SpecError(field, err.get("input"), EXPECTED.get(field, "a valid value"),
                            detail=f"({err['msg']})") from None
        self._check_relations()

    def _check_relations(self) -> None:
        if self.num_heads % self.kv_num_heads:
            raise SpecError("kv_num_heads", self.kv_num_heads,
                            f"a divisor of num_heads={self.num_heads}")
        if self.kv_capacity is not None and self.kv_capacity < self.total_len:
            raise SpecError("kv_capacity", self.kv_capacity,
                            f"None or an integer >= past_len + seq_len = {self.total_len}")
        if self.scale is not None and not F32_TINY <= self.scale <= F32_MAX:
            raise SpecError("scale", self.scale, EXPECTED["scale"])
        for name in ("softcap", "alibi_max_bias"):
            value = getattr(self, name)
            if value != 0 and not F32_TINY <= value <= F32_MAX:
                raise SpecError(name, value, EXPECTED[name])
        if self.total_len > INT_MAX:
            raise SpecError("past_len", self.past_len,
                            f"past_len + seq_len <= 2**31-1 (seq_len={self.seq_len})")
        if self.kv_dtype == "int4" and self.head_size % 32:
            raise SpecError("kv_dtype", self.kv_dtype, "None or 'int8' with head_size="
                            f"{self.head_size}: int4 packs blocks of 32 (head_size % 32 == 0)")
        if self.kv_dtype == "int4" and self.head_size_v % 32:
            raise SpecError("v_head_size", self.v_head_size, "a multiple of 32 with kv_dtype "
                            "'int4' (v packs blocks of 32 too)")
        paged = self.kv_layout == "paged"
        for name in ("page_size", "num_pages"):
            value = getattr(self, name)
            if paged and value is None:
                raise SpecError(name, value, "an integer >= 1, because kv_layout is 'paged'")
            if not paged and value is not None:
                raise SpecError(name, value, "None, because kv_layout is not 'paged'")
        self._check_sizes()

    def _check_sizes(self) -> None:
        """Every tensor's element count must fit int32 (what the kernels index with)."""
        dims = {"batch": self.batch, "seq_len": self.seq_len, "num_heads": self.num_heads,
                "kv_num_heads": self.kv_num_heads, "head_size": self.head_size,
                "v_head_size": self.head_size_v,
                "kv_capacity": self.capacity, "page_size": self.page_size or 1,
                "num_pages": self.num_pages or 1}
        tensors: dict[str, tuple[int, ...]] = {"q": self.q_shape, "k": self.kv_shape,
                                               "v": self.v_shape, "out": self.out_shape}
        if self.bias:
            tensors["bias"] = (self.batch, self.num_heads, self.seq_len, self.capacity)
        if self.kv_layout == "paged":
            tensors["block_table"] = self.block_table_shape
        for tensor, shape in tensors.items():
            n = math.prod(shape)
            if n > INT_MAX:
                biggest = max(dims, key=lambda d: dims[d] if dims[d] in shape else 0)
                field = self._set_field(biggest)
                raise SpecError(field, getattr(self, field),
                                f"a size that keeps {tensor} {shape} ({n} elements) within "
                                "2**31-1 elements (kernels index with int32)")

    def _set_field(self, dim: str) -> str:
        """The field the caller set that gives a derived size: the capacity is past_len +
        seq_len unless kv_capacity is given; v's head size is head_size unless
        v_head_size is."""
        if dim == "kv_capacity" and self.kv_capacity is None:
            return "past_len" if self.past_len >= self.seq_len else "seq_len"
        if dim == "v_head_size" and self.v_head_size is None:
            return "head_size"
        return dim

    # -- derived sizes -------------------------------------------------------------------
    @property
    def total_len(self) -> int:
        """past_len + seq_len: the valid key count when seqlens_k is not given."""
        return self.past_len + self.seq_len

    @property
    def capacity(self) -> int:
        """C: keys allocated per (batch, kv head) in k and v."""
        return self.kv_capacity if self.kv_capacity is not None else self.total_len

    @property
    def head_size_v(self) -> int:
        """Hv: the last dimension of v and out (v_head_size, or head_size)."""
        return self.v_head_size if self.v_head_size is not None else self.head_size

    @property
    def group_size(self) -> int:
        """Query heads per kv head (1 = MHA, num_heads = MQA)."""
        return self.num_heads // self.kv_num_heads

    @property
    def effective_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_size)

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def q_shape(self) -> tuple[int, int, int, int]:
        b, s, n, h = self.batch, self.seq_len, self.num_heads, self.head_size
        return (b, s, n, h) if self.q_layout == "BSNH" else (b, n, s, h)

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        b, c, n, h = self.batch, self.capacity, self.kv_num_heads, self.head_size
        if self.kv_layout == "paged":
            assert self.num_pages is not None and self.page_size is not None
            return (self.num_pages, self.page_size, n, h)
        return (b, c, n, h) if self.kv_layout == "BSNH" else (b, n, c, h)

    @property
    def v_shape(self) -> tuple[int, int, int, int]:
        """v's shape: kv_shape with the last dimension Hv."""
        return (*self.kv_shape[:3], self.head_size_v)

    @property
    def kv_code_shape(self) -> tuple[int, ...]:
        """Shape of the k tensor as stored: kv_shape, or [.., H/2] bytes for int4."""
        if self.kv_dtype == "int4":
            return (*self.kv_shape[:3], self.head_size // 2)
        return self.kv_shape

    @property
    def v_code_shape(self) -> tuple[int, ...]:
        """Shape of the v tensor as stored: v_shape, or [.., Hv/2] bytes for int4."""
        if self.kv_dtype == "int4":
            return (*self.kv_shape[:3], self.head_size_v // 2)
        return self.v_shape

    @property
    def kv_code_dtype(self) -> str:
        return {"int8": "int8", "int4": "uint8"}.get(self.kv_dtype or "", self.dtype)

    @property
    def kv_scale_shape(self) -> tuple[int, ...]:
        """Shape of k_scale: one per vector (int8), one per 32 elements (int4)."""
        lead = self.kv_shape[:3]
        return lead if self.kv_dtype == "int8" else (*lead, self.head_size // 32)

    @property
    def v_scale_shape(self) -> tuple[int, ...]:
        """Shape of v_scale: one per vector (int8), one per 32 elements of Hv (int4)."""
        lead = self.kv_shape[:3]
        return lead if self.kv_dtype == "int8" else (*lead, self.head_size_v // 32)

    @property
    def kv_scale_dtype(self) -> str:
        return "float32" if self.kv_dtype == "int8" else "float16"

    @property
    def pages_per_seq(self) -> int:
        """Block-table width for a paged cache: pages covering the capacity C."""
        return -(-self.capacity // self.page_size) if self.page_size else 0

    @property
    def block_table_shape(self) -> tuple[int, int]:
        return (self.batch, self.pages_per_seq)

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        """q's shape with the last dimension Hv."""
        return (*self.q_shape[:3], self.head_size_v)

    @property
    def lse_shape(self) -> tuple[int, int, int]:
        return (self.batch, self.num_heads, self.seq_len)

    @property
    def features(self) -> frozenset[str]:
        """Contract features this spec uses, by the names kernels declare support with."""
        f = set()
        if self.causal:
            f.add("causal")
        if self.bias:
            f.add("bias")
        if self.seqlens_k:
            f.add("seqlens_k")
        if self.head_sink:
            f.add("head_sink")
        if self.return_lse:
            f.add("return_lse")
        if self.softcap > 0:
            f.add("softcap")
        if self.local_window > 0:
            f.add("local_window")
        # Under causal masking a right window hides nothing more (j <= p_i already), so it
        # is a feature only where it can change the result: a kernel that does not
        # implement it still runs a causal spec that carries one, with the same answer.
        if self.right_window >= 0 and not self.causal:
            f.add("right_window")
        if self.alibi_max_bias > 0:
            f.add("alibi")
        if self.kv_capacity is not None and self.kv_capacity != self.total_len:
            f.add("kv_capacity")
        if self.group_size > 1:
            f.add("gqa")
        if self.head_size_v != self.head_size:
            f.add("v_head_size")
        if self.kv_start:
            f.add("kv_start")
        if self.seqlens_q:
            f.add("seqlens_q")
        return frozenset(f)

    def replace(self, **changes: Any) -> AttentionSpec:
        """A validated copy with some fields changed (model_copy would skip validation)."""
        return AttentionSpec(**{**self.model_dump(), **changes})

    def short(self) -> str:
        """A compact, readable id such as ``b2-s1-p1023-h32/8-d128-f16-causal-seqlens``."""
        parts = [f"b{self.batch}", f"s{self.seq_len}", f"p{self.past_len}",
                 f"h{self.num_heads}/{self.kv_num_heads}", f"d{self.head_size}"
                 + (f"v{self.head_size_v}" if self.head_size_v != self.head_size else ""),
                 {"float16": "f16", "bfloat16": "bf16"}.get(self.dtype, "f32")]
        if self.kv_dtype is not None:
            parts.append(f"kv{self.kv_dtype}")
        if self.q_layout != "BSNH" or self.kv_layout != "BNSH":
            parts.append(f"q{self.q_layout}-kv{self.kv_layout}")
        parts += sorted(self.features - {"gqa", "v_head_size"})
        return "-".join(parts)

    def __repr__(self) -> str:
        # Only non-default fields: short enough to read, still valid Python to paste.
        defaults = {k: f.default for k, f in type(self).model_fields.items()}
        items = [f"{k}={v!r}" for k, v in self.model_dump().items() if v != defaults[k]]
        return f"AttentionSpec({', '.join(items)})"

    __str__ = __repr__
