// What the OpenCL attention families share: rows, key ranges, tiles, the K/V staging and
// the logits (the flash loop itself is flash_rows.cl).
// Compile-time constants (set by backends/opencl/program.py; HD and HV in common.cl):
//   WG       work-items per work-group
//   GC, MQ   rows of a work-group = GC query heads x MQ query rows
//   TK       keys per tile staged in local memory
//   KL, DL   key lanes of the score phase, float4 dim lanes of the P.V phase
//   STAGE_V  1: V tiles go through local memory too (when the device has room)
//   PAGED    0: K/V rows are contiguous per (batch, kv head); else the page size of a paged
//            pool [num_pages, PAGED, Nkv, H] whose pages the block table maps
//   BLOCK_SKIP 1: iterate over the KV blocks of a CSR block list instead of every tile
// K/V tiles are software-pipelined: each work-item holds its share of the next tile in
// registers (NLD float4 groups, raw storage bits) while the current tile is computed.

#define R_ROWS (GC * MQ)
#define KP (HD + 4)            // K/Q tile row pitch: +4 floats keeps float4 reads conflict-free
#define RL (WG / KL)           // row lanes in the score phase
#define MR ((R_ROWS + RL - 1) / RL)
#define NK (TK / KL)
#define PRL (WG / DL)          // row lanes in the P.V phase
#define PMR ((R_ROWS + PRL - 1) / PRL)
#define DV ((HV4 + DL - 1) / DL)  // float4 groups of V (and out) per P.V lane
#define NLD ((TK * HD4 + WG - 1) / WG)
#define NLDV ((TK * HV4 + WG - 1) / WG)

#ifndef PAGED
#define PAGED 0
#endif
#ifndef BLOCK_SKIP
#define BLOCK_SKIP 0
#endif

// Element offset of key j's row from the (batch, kv head) base. Paged: the page the block
// table row `btab` (this batch's) maps key j to; only pages of keys < L_b are ever looked
// up, so unused (-1) entries and unused pages are never touched.
#if PAGED
#define KV_BASE(P, b, kvh) ((size_t)(kvh) * (P)->kv_sh)
#define KOFF(j) ((size_t)btab[(j) / PAGED] * P->kv_sb + (size_t)((j) % PAGED) * P->kv_ss)
#define BTAB(P, table, b) ((table) + (size_t)(b) * (P)->pages_per_seq)
#else
#define KV_BASE(P, b, kvh) ((size_t)(b) * (P)->kv_sb + (size_t)(kvh) * (P)->kv_sh)
#define KOFF(j) ((size_t)(j) * P->kv_ss)
#define BTAB(P, table, b) (table)
#endif

// The work-group's K/V pointers as FETCH, KOFF and the kernels' own loads take them from scope:
// btab (its batch's block-table row), kb / vb (K / V of its (batch, kv head)) and ksb / vsb
// (their scales). Reads P, block_table, k, v, k_scale and v_scale (kernel arguments).
#define KV_POINTERS(W)                                                  \
  const size_t kv_base = KV_BASE(P, (W).b, (W).kvh);                    \
  const __global int* btab = BTAB(P, block_table, (W).b);               \
  const __global kv_t* kb = KV_AT(k, kv_base);                          \
  const __global kv_t* vb = KV_AT(v, VOFF(kv_base));                    \
  const __global scale_t* ksb = SC_AT(k_scale, kv_base);                \
  const __global scale_t* vsb = SCV_AT(v_scale, VOFF(kv_base));

// Load this work-item's share of the tile of keys [T0, T1) (zeros past T1: nothing beyond
// the range is read). Needs lid, P, btab, kb, vb, ksb, vsb (KV_POINTERS), pk, pv (FETCH_FIRST)
// in scope. V rows of another length (HV != HD) take a loop of their own (V's offset is VOFF
// of K's).
#if HV == HD
#define FETCH(T0, T1)                                                   \
  for (int n = 0; n < NLD; ++n) {                                       \
    const int idx_ = lid + n * WG, jj_ = idx_ / HD4, g_ = idx_ % HD4;   \
    pk[n] = KV_RAW_ZERO;                                                \
    pv[n] = KV_RAW_ZERO;                                                \
    if (idx_ < TK * HD4 && (T0) + jj_ < (T1)) {                         \
      const size_t ro_ = KOFF((T0) + jj_);                              \
      pk[n] = KV_LDRAW(kb, ksb, ro_, 4 * g_);                           \
      if (STAGE_V) pv[n] = KV_LDRAW(vb, vsb, ro_, 4 * g_);              \
    }                                                                   \
  }
#else
#define FETCH(T0, T1)                                                   \
  for (int n = 0; n < NLD; ++n) {                                       \
    const int idx_ = lid + n * WG, jj_ = idx_ / HD4, g_ = idx_ % HD4;   \
    pk[n] = KV_RAW_ZERO;                                                \
    if (idx_ < TK * HD4 && (T0) + jj_ < (T1))                           \
      pk[n] = KV_LDRAW(kb, ksb, KOFF((T0) + jj_), 4 * g_);              \
  }                                                                     \
  for (int n = 0; n < NLDV; ++n) {                                      \
    const int idx_ = lid + n * WG, jj_ = idx_ / HV4, g_ = idx_ % HV4;   \
    pv[n] = KV_RAW_ZERO;                                                \
    if (STAGE_V && idx_ < TK * HV4 && (T0) + jj_ < (T1))                \
      pv[n] = V_LDRAW(vb, vsb, VOFF(KOFF((T0) + jj_)), 4 * g_);         \
  }
#endif

// Registers -> local tiles (K with pitch KPITCH, V with pitch HV), converted (dequantized)
// to f32: staging is 4 bytes a value whatever the storage (tiles.py counts it so).
#if HV == HD
#define STORE_TILE(KPITCH)                                              \
  for (int n = 0; n < NLD; ++n) {                                       \
    const int idx_ = lid + n * WG, jj_ = idx_ / HD4, g_ = idx_ % HD4;   \
    if (idx_ < TK * HD4) {                                              \
      vstore4(kv_cvt4(pk[n]), 0, Ks + jj_ * (KPITCH) + 4 * g_);         \
      if (STAGE_V) vstore4(kv_cvt4(pv[n]), 0, Vs + jj_ * HD + 4 * g_);  \
    }                                                                   \
  }
#else
#define STORE_TILE(KPITCH)                                              \
  for (int n = 0; n < NLD; ++n) {                                       \
    const int idx_ = lid + n * WG, jj_ = idx_ / HD4, g_ = idx_ % HD4;   \
    if (idx_ < TK * HD4) vstore4(kv_cvt4(pk[n]), 0, Ks + jj_ * (KPITCH) + 4 * g_); \
  }                                                                     \
  for (int n = 0; n < NLDV; ++n) {                                      \
    const int idx_ = lid + n * WG, jj_ = idx_ / HV4, g_ = idx_ % HV4;   \
    if (STAGE_V && idx_ < TK * HV4) vstore4(kv_cvt4(pv[n]), 0, Vs + jj_ * HV + 4 * g_); \
  }
#endif

// The software pipeline of a flash loop over the tiles TS (block ids IDS): before the loop,
// the registers and the first tile's fetch (tr: the keys of the tile fetched last) ...
#define FETCH_FIRST(TS, IDS)                                            \
  kvraw_t pk[NLD], pv[NLDV];                                            \
  int2 tr = tile_keys(&(TS), IDS, 0);                                   \
  FETCH(tr.x, tr.y)
// ... and in tile IT, the fetched tile staged (K pitch KPITCH), then the next one fetched.
#define STAGE_NEXT(KPITCH, TS, IDS, IT)                                 \
  STORE_TILE(KPITCH)                                                    \
  barrier(CLK_LOCAL_MEM_FENCE);                                         \
  tr = tile_keys(&(TS), IDS, (IT) + 1);                                \
  FETCH(tr.x, tr.y)

inline float alibi_slope(PARAMS P, int h) {
  return (uint)h < P->alibi_n ? exp2(P->alibi_e0 * (float)(h + 1))
                              : exp2(P->alibi_e1 * (float)(2 * (h - (int)P->alibi_n) + 1));
}

inline int valid_len(PARAMS P, const __global int* seqlens, int b) {
  return P->has_seqlens ? seqlens[b] : (int)P->total_len;
}

// The shapes real models need (docs/contract.md "Shapes real models need"): batch b's first
// existing key kv_start[b] (left padding: keys before it are never loaded) and its query row
// count S_b = seqlens_q[b] (rows past it are padding: they see nothing, take no sink, and are
// written as out 0 and lse -inf). Without the tensors: key 0 and seq_len rows, so p_i = L_b - S_b
// + i is the usual L_b - seq_len + i.
inline int first_key(PARAMS P, const __global int* kv_start, int b) {
  return P->has_kv_start ? kv_start[b] : 0;
}
inline int q_rows(PARAMS P, const __global int* seqlens_q, int b) {
  return P->has_seqlens_q ? seqlens_q[b] : (int)P->seq_len;
}

// min(hi, p + right_window + 1): the end of the keys a row at position p may see on the
// right (two-sided windows), or hi without a right window. Compared as a difference, so a
// window near 2**31 never overflows (p >= 0: the S_b rows are the last of L_b >= S_b keys).
// RIGHT_WINDOW: the right window's tests are built in for specs with a right window, and on
// CPU devices for every spec (program.window_tests); a GPU's other programs leave them out.
#ifndef RIGHT_WINDOW
#define RIGHT_WINDOW 0
#endif
inline int right_end(PARAMS P, int p, int hi) {
  return (RIGHT_WINDOW && P->right_window >= 0 && P->right_window < hi - p)
      ? p + P->right_window + 1 : hi;
}

// Row r of a work-group: query head h0 + r / MQ, query row i0 + r % MQ.
typedef struct {
  int b, kvh, h0, gcv, i0, L;   // batch, kv head, first head, valid heads, first row, L_b
  int S, ks;                    // the batch's query rows S_b and first key kv_start[b]
} Rows;

// Whether row r is an output row of the work-group (padding rows included) ...
inline bool row_ok(PARAMS P, const Rows* w, int r) {
  return r < R_ROWS && r / MQ < w->gcv && w->i0 + r % MQ < (int)P->seq_len;
}

// ... and whether it is a live one (not padding): the only rows whose q is read.
inline bool row_live(PARAMS P, const Rows* w, int r) {
  return row_ok(P, w, r) && w->i0 + r % MQ < w->S;
}

// Keys [lo, hi) that any live row of a work-group may see, intersected with [klo, khi):
// from kv_start to L_b, causality and the windows (empty when every row is padding).
// Everything outside is skipped by loop bounds, so memory before kv_start, past L_b (or
// outside the windows) is never read, and whole tiles outside them are never visited.
inline int2 key_range(PARAMS P, const Rows* w, int klo, int khi) {
  const int i1 = min(w->i0 + MQ, w->S) - 1;             // the last live row
  const int p0 = w->L - w->S + w->i0, p1 = w->L - w->S + i1;
  int hi = min(khi, w->L);
  if (P->causal) hi = min(hi, p1 + 1);
  hi = right_end(P, p1, hi);
  int lo = max(klo, w->ks);
  if (P->local_window > 0) lo = max(lo, p0 - P->local_window + 1);
  if (i1 < w->i0) hi = lo;
  return (int2)(lo, hi);
}

// Whether row r sees key j (positional: kv_start, L_b, causality, the windows; a padding
// row sees nothing).
inline bool key_seen(PARAMS P, const Rows* w, int r, int j) {
  const int i = w->i0 + r % MQ, p = w->L - w->S + i;
  return i < w->S && j >= w->ks && j < w->L && (!P->causal || j <= p)
      && (P->local_window <= 0 || j > p - P->local_window)
      && (!RIGHT_WINDOW || P->right_window < 0 || j - p <= P->right_window);
}

// Keys [lo, hi) that row r sees (a contiguous range: kv_start, L_b, causality, the windows;
// empty for a padding row). Loops over edge tiles test j against it: two compares per
// (row, key), hoisted out of the element loop.
inline int2 row_keys(PARAMS P, const Rows* w, int r) {
  const int i = w->i0 + r % MQ, p = w->L - w->S + i;
  int hi = i < w->S ? w->L : 0, lo = w->ks;
  if (P->causal) hi = min(hi, p + 1);
  hi = right_end(P, p, hi);
  if (P->local_window > 0) lo = max(lo, p - P->local_window + 1);
  return (int2)(lo, hi);
}

// Keys [lo, hi) that every live row of the work-group sees. P.V multiplies a tile's weights
// with its values unmasked only when the tile lies inside: elsewhere a row's weight of 0 for
// a key it cannot see would meet that key's value (0 * NaN = NaN), so tiles on the causal
// diagonal or either window's edge select each contribution by key_seen. (Padding rows may
// meet such a product: they are written as 0 and -inf whatever they accumulated.)
inline int2 common_keys(PARAMS P, const Rows* w) {
  const int i1 = min(w->i0 + MQ, w->S) - 1;
  const int p0 = w->L - w->S + w->i0, p1 = w->L - w->S + i1;
  int hi = w->L;
  if (P->causal) hi = min(hi, p0 + 1);
  hi = right_end(P, p0, hi);
  int lo = w->ks;
  if (P->local_window > 0) lo = max(lo, p1 - P->local_window + 1);
  return (int2)(lo, hi);
}

// Whether keys [a, b) (b <= a: none) all lie in the common keys ckeys.
inline bool all_see(int2 ckeys, int a, int b) {
  return b <= a || (a >= ckeys.x && b <= ckeys.y);
}

// Score of row r against key j (scaled q already applied); -inf if masked or j >= jend.
// ALiBi is taken relative to kref - 1 (the end of the row tile's key range); use_bias 0
// skips the bias of a block the block list marks all-zero. A visible key's score is NaN
// where q.k is not finite (q or k not finite) or the logit is NaN or +inf: the row turns
// NaN (docs/contract.md "Non-finite values and scalar fields"); a -inf bias masks the key.
inline float finish_score_r(PARAMS P, const Rows* w, const __global bias_t* bias,
                            int r, int j, int jend, int kref, bool use_bias, float dotv) {
  const int khi = kref;
  if (!row_live(P, w, r) || j >= jend) return -INFINITY;
  int h = w->h0 + r / MQ, i = w->i0 + r % MQ;
  int p = w->L - w->S + i;
  if (P->causal && j > p) return -INFINITY;
  if (P->local_window > 0 && j <= p - P->local_window) return -INFINITY;
  if (RIGHT_WINDOW && P->right_window >= 0 && j - p > P->right_window) return -INFINITY;
  float s = isfinite(dotv) ? dotv : NAN;
  if (P->softcap > 0.0f) s = P->softcap * tanh(s / P->softcap);
  if (P->has_bias && use_bias)
    s += LDB(bias, (size_t)w->b * P->bias_sb + (size_t)h * P->bias_sh + (size_t)i * P->bias_ss
                       + (size_t)j);
  // ALiBi relative to the last key of the range, not to p: the heaviest keys then carry
  // small logits and keep f32 precision; alibi_offset() restores p for the lse.
  if (P->has_alibi) s += alibi_slope(P, h) * (float)(j - (khi - 1));
  return (isnan(s) || s == INFINITY) ? NAN : s;
}

inline float finish_score(PARAMS P, const Rows* w, const __global bias_t* bias,
                          int r, int j, int khi, float dotv) {
  return finish_score_r(P, w, bias, r, j, khi, khi, true, dotv);
}

// Where row r's split-t partial state (or statistics) goes: [B, Nq, S, T] order.
inline size_t part_row(PARAMS P, const Rows* w, int r, int t) {
  const int h = w->h0 + r / MQ, i = w->i0 + r % MQ;
  return ((size_t)(w->b * (int)P->num_heads + h) * P->seq_len + i) * P->n_splits + t;
}

// Start of row r's scores in a [B, Nq, S, C] buffer (the unfused decode).
#define SCORE_ROW(P, w, r) (part_row((P), (w), (r), 0) / (P)->n_splits * (P)->capacity)

// What the scores of row r lack, for an absolute lse (0 without ALiBi).
inline float alibi_offset(PARAMS P, const Rows* w, int r, int khi) {
  if (!P->has_alibi) return 0.0f;
  int p = w->L - w->S + w->i0 + r % MQ;
  return alibi_slope(P, w->h0 + r / MQ) * (float)(khi - 1 - p);
}

// Element offset of (batch b, head h, row i) in q; out's is OUT_OFF of it (rows of HV).
#define Q_OFF(P, b, h, i) ((size_t)(b) * (P)->q_sb + (size_t)(h) * (P)->q_sh + (size_t)(i) * (P)->q_ss)
#define OUT_OFF(P, b, h, i) VOFF(Q_OFF(P, b, h, i))

// Stage the work-group's query rows, pre-scaled, in Qs (zeros for invalid and padding
// rows: a padding row's q may hold anything and is never read).
inline void load_q(PARAMS P, const Rows* w, const __global elem_t* q, __local float* Qs) {
  for (int idx = get_local_id(0); idx < R_ROWS * HD4; idx += WG) {
    int r = idx / HD4, g = idx % HD4;
    float4 x = (float4)(0.0f);
    if (row_live(P, w, r)) {
      int h = w->h0 + r / MQ, i = w->i0 + r % MQ;
      x = LD4(q, (size_t)w->b * P->q_sb + (size_t)h * P->q_sh + (size_t)i * P->q_ss + 4 * g)
          * P->scale;
    }
    vstore4(x, 0, Qs + r * KP + 4 * g);
  }
}

// The tiles a work-group visits within its key range kr: dense, every TK keys from kr.x;
// with BLOCK_SKIP, the listed blocks ids[first .. first + count) (ascending block indices
// of TK keys) clipped to kr. Tile `it` covers keys [x, y); past the end it is empty.
typedef struct {
  int2 kr;
  int first, count;
} Tiles;

inline Tiles dense_tiles(int2 kr) {
  Tiles t;
  t.kr = kr;
  t.first = 0;
  t.count = kr.y > kr.x ? (kr.y - kr.x + TK - 1) / TK : 0;
  return t;
}

inline int2 tile_keys(const Tiles* ts, const __global int* ids, int it) {
  if (it >= ts->count) return (int2)(0, 0);
#if BLOCK_SKIP
  const int b = ids[ts->first + it];
  return (int2)(max(b * TK, ts->kr.x), min(b * TK + TK, ts->kr.y));
#else
  const int t0 = ts->kr.x + it * TK;
  return (int2)(t0, min(t0 + TK, ts->kr.y));
#endif
}

// Whether tile `it` needs its bias (a listed block marked all-zero does not).
inline bool tile_bias(const Tiles* ts, const __global int* zero, int it) {
#if BLOCK_SKIP
  return it >= ts->count || zero[ts->first + it] == 0;
#else
  return true;
#endif
}

// Block-list row of a work-group: the bias's own broadcast (batch, head) x query tile.
inline int list_row(PARAMS P, const Rows* w) {
  const int nqt = ((int)P->seq_len + MQ - 1) / MQ;
  const int hb = P->bias_sh ? (int)P->num_heads : 1;
  return ((P->bias_sb ? w->b : 0) * hb + (P->bias_sh ? w->h0 : 0)) * nqt + w->i0 / MQ;
}

// Entries [x, y) of a block-list row whose blocks intersect the key range kr.
inline int2 listed(const __global int* off, const __global int* ids, int row, int2 kr) {
  int a = off[row], e = off[row + 1];
  while (a < e && (ids[a] + 1) * TK <= kr.x) ++a;
  while (e > a && ids[e - 1] * TK >= kr.y) --e;
  return (int2)(a, e);
}

// Work-group tile -> rows. Splits/row tiles vary fastest so neighbours share K/V in cache.
inline Rows decompose(PARAMS P, const __global int* seqlens, const __global int* kv_start,
                      const __global int* seqlens_q, int gid, int n_splits, int* split) {
  const int rt_n = ((int)P->seq_len + MQ - 1) / MQ;
  const int hc_n = ((int)P->group_size + GC - 1) / GC;
  Rows w;
  int rt = gid % rt_n;
  gid /= rt_n;
  int hc = gid % hc_n;
  gid /= hc_n;
  *split = gid % n_splits;
  gid /= n_splits;
  w.kvh = gid % (int)P->kv_num_heads;
  w.b = gid / (int)P->kv_num_heads;
  w.h0 = w.kvh * (int)P->group_size + hc * GC;
  w.gcv = min(GC, (int)P->group_size - hc * GC);
  w.i0 = rt * MQ;
  w.L = valid_len(P, seqlens, w.b);
  w.S = q_rows(P, seqlens_q, w.b);
  w.ks = first_key(P, kv_start, w.b);
  return w;
}

// Keys split t of a decode work-group visits: its [t * split_size, ...) share of the
// capacity, within the span its rows may see (key_range).
inline int2 split_keys(PARAMS P, const Rows* w, int t) {
  const int lo = t * (int)P->split_size;
  const int hi = min(lo + (int)P->split_size, (int)P->capacity);
  return key_range(P, w, lo, hi);
}
