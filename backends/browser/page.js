// The attnreg browser backend's page. It reports the WebGPU adapter to the Python host
// (POST /hello), then, in mode "run", opens a device and serves jobs: GET /job (long poll)
// returns one binary message (wire.js / wire.py: header JSON + 16-byte aligned blobs)
// naming buffers to fill, WGSL stages to compile (cached by source hash) and dispatch, and
// outputs to read back; the reply goes to POST /result in the same framing.
import {align, describe, encode, nextJob, postJSON, post, query, reportErrors} from './wire.js';

const MODE = query.get('mode') || 'run';
// Compute limits the kernels may need: the device gets the adapter's full values.
const LIMITS = ['maxComputeWorkgroupStorageSize', 'maxComputeInvocationsPerWorkgroup',
  'maxComputeWorkgroupSizeX', 'maxComputeWorkgroupSizeY', 'maxComputeWorkgroupSizeZ',
  'maxComputeWorkgroupsPerDimension', 'maxStorageBufferBindingSize', 'maxBufferSize',
  'maxStorageBuffersPerShaderStage', 'maxUniformBufferBindingSize'];
const FEATURES = ['subgroups', 'shader-f16', 'timestamp-query'];

// -- the runner ---------------------------------------------------------------------------
let device = null;
const buffers = new Map();     // name -> {buf, size}
const layouts = new Map();     // binding kinds -> {bgl, pl}
const pipelines = new Map();   // source key -> GPUComputePipeline
const USAGE = () => ({
  uniform: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST,
  storage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST,
  readback: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST,
});

// A buffer of at least `size` bytes, reused while big enough.
function ensure(name, size, usage) {
  size = Math.max(16, align(size));
  const got = buffers.get(name);
  if (got && got.size >= size) return got.buf;
  if (got) got.buf.destroy();
  const buf = device.createBuffer({label: name, size, usage: USAGE()[usage]});
  buffers.set(name, {buf, size});
  return buf;
}

function layout(bindings) {
  const key = bindings.map(([b, kind]) => `${b}:${kind}`).join(',');
  let got = layouts.get(key);
  if (!got) {
    const type = {uniform: 'uniform', read: 'read-only-storage', rw: 'storage'};
    const bgl = device.createBindGroupLayout({entries: bindings.map(([binding, kind]) => ({
      binding, visibility: GPUShaderStage.COMPUTE, buffer: {type: type[kind]}}))});
    got = {bgl, pl: device.createPipelineLayout({bindGroupLayouts: [bgl]})};
    layouts.set(key, got);
  }
  return got;
}

function formatMessages(messages, code) {
  const lines = code.split('\n');
  return messages.map((m) => {
    const src = m.lineNum > 0 ? `\n    ${(lines[m.lineNum - 1] || '').trim()}` : '';
    return `${m.type} at line ${m.lineNum}:${m.linePos}: ${m.message}${src}`;
  }).join('\n');
}

// The pipeline of one stage: {pipe} or {error} with Tint's messages.
async function pipeline(st, warnings) {
  const have = pipelines.get(st.key);
  if (have) return {pipe: have};
  if (st.wgsl == null) return {error: `no source for ${st.key} on this page`, missing: true};
  device.pushErrorScope('validation');
  const module = device.createShaderModule({label: st.label, code: st.wgsl});
  const info = await module.getCompilationInfo();
  const scoped = await device.popErrorScope();
  const errors = info.messages.filter((m) => m.type === 'error');
  const others = info.messages.filter((m) => m.type !== 'error');
  if (others.length) warnings.push(`${st.label}: ${formatMessages(others, st.wgsl)}`);
  if (errors.length || scoped) {
    return {error: errors.length ? formatMessages(errors, st.wgsl) : scoped.message};
  }
  try {
    const pipe = await device.createComputePipelineAsync({
      label: st.label, layout: layout(st.bindings).pl, compute: {module, entryPoint: st.entry}});
    pipelines.set(st.key, pipe);
    return {pipe};
  } catch (e) {
    return {error: `pipeline creation failed: ${e.message}`};
  }
}

async function runJob({header: h, blobs}) {
  const warnings = [];
  const t0 = performance.now();
  const pipes = [];
  for (const st of h.stages) {
    const got = await pipeline(st, warnings);
    if (got.error) {
      return [{ok: false, kind: got.missing ? 'missing' : 'compile', stage: st.label,
        key: st.key, error: got.error, warnings}, []];
    }
    pipes.push(got.pipe);
  }
  const t1 = performance.now();
  device.pushErrorScope('out-of-memory');
  device.pushErrorScope('validation');
  for (const b of h.buffers) {
    const buf = ensure(b.name, b.size, b.usage);
    const data = b.blob ? blobs.get(b.blob) : null;
    if (data && data.byteLength) device.queue.writeBuffer(buf, 0, data.buffer, data.byteOffset, data.byteLength);
  }
  const enc = device.createCommandEncoder();
  const pass = enc.beginComputePass();
  h.stages.forEach((st, i) => {
    const group = device.createBindGroup({layout: layout(st.bindings).bgl, entries: st.bindings.map(
      ([binding, , name]) => ({binding, resource: {buffer: buffers.get(name).buf}}))});
    pass.setPipeline(pipes[i]);
    pass.setBindGroup(0, group);
    pass.dispatchWorkgroups(...st.grid);
  });
  pass.end();
  const reads = h.outputs.map((o) => {
    const size = align(o.size, 4);
    const rb = ensure(`rb_${o.name}`, size, 'readback');
    enc.copyBufferToBuffer(buffers.get(o.buffer).buf, 0, rb, 0, size);
    return {o, rb, size};
  });
  device.queue.submit([enc.finish()]);
  const invalid = await device.popErrorScope();
  const oom = await device.popErrorScope();
  if (invalid || oom) {
    return [{ok: false, kind: oom ? 'out-of-memory' : 'validation', error: (invalid || oom).message,
      warnings}, []];
  }
  await Promise.all(reads.map(({rb, size}) => rb.mapAsync(GPUMapMode.READ, 0, size)));
  const out = reads.map(({o, rb, size}) => {
    const copy = new Uint8Array(rb.getMappedRange(0, size).slice(0, o.size));
    rb.unmap();
    return [o.name, copy];
  });
  const t2 = performance.now();
  return [{ok: true, warnings, ms: {compile: t1 - t0, run: t2 - t1}}, out];
}

async function serve() {
  for (;;) {
    const job = await nextJob();
    if (!job) return;
    let reply;
    try {
      const [head, out] = await runJob(job);
      reply = encode({id: job.header.id, ...head}, out);
    } catch (e) {
      reply = encode({id: job.header.id, ok: false, kind: 'error', error: String(e && e.stack || e)}, []);
    }
    await post('result', reply);
  }
}

async function main() {
  const hello = {mode: MODE};
  try {
    if (!navigator.gpu) throw new Error('navigator.gpu is undefined (WebGPU disabled or unsupported)');
    const adapter = await navigator.gpu.requestAdapter();
    if (!adapter) throw new Error('navigator.gpu.requestAdapter() returned null (no WebGPU adapter)');
    Object.assign(hello, describe(adapter));
    const requiredFeatures = FEATURES.filter((f) => adapter.features.has(f));
    const requiredLimits = {};
    for (const k of LIMITS) if (adapter.limits[k] !== undefined) requiredLimits[k] = adapter.limits[k];
    device = await adapter.requestDevice({requiredFeatures, requiredLimits});
    hello.deviceFeatures = [...device.features].sort();
  } catch (e) {
    hello.error = String(e && e.message || e);
  }
  await postJSON('hello', hello);
  if (!device || MODE !== 'run') return;
  device.lost.then((i) => postJSON('event', {kind: 'lost', reason: i.reason, message: i.message}));
  device.addEventListener('uncapturederror', (ev) => postJSON('event', {kind: 'uncaptured', message: ev.error.message}));
  await serve();
}

reportErrors();
main();
