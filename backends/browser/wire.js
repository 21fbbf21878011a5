// The page side of backends/browser/wire.py: "ATRG", a u32 header length, the header as
// JSON, then 16-byte aligned blobs listed in header.blobs. Plus the token-carrying fetch
// helpers every attnreg page uses to talk to its host.
export const query = new URLSearchParams(location.search);
const TOKEN = query.get('t');
const MAGIC = 0x47525441;          // "ATRG" as a little-endian u32

export const align = (n, a = 16) => Math.ceil(n / a) * a;
export const url = (path) => `/${path}?t=${TOKEN}`;
export const post = (path, body) => fetch(url(path), {method: 'POST', body});
export const postJSON = (path, obj) => post(path, JSON.stringify(obj));

export function decode(buf) {
  const dv = new DataView(buf);
  if (buf.byteLength < 8 || dv.getUint32(0, true) !== MAGIC) throw new Error('not an attnreg message');
  const n = dv.getUint32(4, true);
  const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buf, 8, n)));
  const base = align(8 + n);
  const blobs = new Map();
  for (const b of header.blobs || []) blobs.set(b.name, new Uint8Array(buf, base + b.offset, b.size));
  return {header, blobs};
}

// blobs: [name, ArrayBufferView][]
export function encode(header, blobs) {
  const table = [];
  let off = 0;
  for (const [name, data] of blobs) {
    table.push({name, offset: off, size: data.byteLength});
    off += align(data.byteLength);
  }
  const head = new TextEncoder().encode(JSON.stringify({...header, blobs: table}));
  const base = align(8 + head.byteLength);
  const out = new Uint8Array(base + off);
  const dv = new DataView(out.buffer);
  dv.setUint32(0, MAGIC, true);
  dv.setUint32(4, head.byteLength, true);
  out.set(head, 8);
  blobs.forEach(([, data], i) => out.set(
    new Uint8Array(data.buffer, data.byteOffset, data.byteLength), base + table[i].offset));
  return out;
}

export function describe(adapter) {
  const info = {};
  for (const k in adapter.info) {
    const v = adapter.info[k];
    if (['string', 'number', 'boolean'].includes(typeof v)) info[k] = v;
  }
  const limits = {};
  for (const k in adapter.limits) limits[k] = adapter.limits[k];
  return {info, features: [...adapter.features].sort(), limits, userAgent: navigator.userAgent};
}

// The next job from the host (long poll): a decoded message, or null once the host closes.
export async function nextJob() {
  let failures = 0;
  for (;;) {
    let r;
    try {
      r = await fetch(url('job'));
      failures = 0;
    } catch (e) {
      if (++failures > 50) return null;     // the host is gone
      await new Promise((res) => setTimeout(res, 100));
      continue;
    }
    if (r.status === 204) continue;
    if (r.status !== 200) return null;      // 410: the host is closing
    return decode(await r.arrayBuffer());
  }
}

export function reportErrors() {
  addEventListener('error', (ev) => postJSON('event', {kind: 'fatal', message: String(ev.message)}));
  addEventListener('unhandledrejection', (ev) => postJSON('event', {kind: 'fatal', message: String(ev.reason)}));
}
