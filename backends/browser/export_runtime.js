// ---- attnreg runtime (the same for every export; the constants above are this spec's) ----

const DEFAULT_LIMITS = {maxComputeWorkgroupStorageSize: 16384, maxComputeInvocationsPerWorkgroup: 256,
  maxComputeWorkgroupSizeX: 256, maxStorageBufferBindingSize: 134217728, maxBufferSize: 268435456,
  maxComputeWorkgroupsPerDimension: 65535, maxStorageBuffersPerShaderStage: 8};
const BINDING_TYPES = {uniform: 'uniform', read: 'read-only-storage', rw: 'storage'};
const align = (n, a) => Math.ceil(n / a) * a;
const product = (shape) => shape.reduce((a, b) => a * b, 1);

/** What this adapter lacks for these kernels ([] when it has everything). */
export function adapterProblems(adapter) {
  const why = REQUIRED_FEATURES.filter((f) => !adapter.features.has(f))
    .map((f) => `adapter lacks feature ${f}`);
  for (const [name, need] of Object.entries(REQUIRED_LIMITS)) {
    if (!(adapter.limits[name] >= need)) why.push(`needs ${name} >= ${need}, adapter has ${adapter.limits[name]}`);
  }
  const sgMin = adapter.info && adapter.info.subgroupMinSize;
  if (SUBGROUP_MIN_SIZE > 1 && sgMin !== undefined && sgMin < SUBGROUP_MIN_SIZE) {
    why.push(`kernels assume subgroups of >= ${SUBGROUP_MIN_SIZE} lanes, adapter's minimum is ${sgMin}`);
  }
  return why;
}

/** A device with the features and limits these kernels need. */
export async function requestDevice(adapter) {
  const why = adapterProblems(adapter);
  if (why.length) throw new Error(`attention.js cannot run on this adapter: ${why.join('; ')}`);
  const requiredLimits = {};
  for (const [name, need] of Object.entries(REQUIRED_LIMITS)) {
    if (need > (DEFAULT_LIMITS[name] ?? 0)) requiredLimits[name] = need;
  }
  return adapter.requestDevice({requiredFeatures: REQUIRED_FEATURES, requiredLimits});
}

/** The parameter block for a bias of `biasShape` ([Bb, Nb, Sb, C], any of the first three
 *  may be 1): PARAMS with the bias strides patched (0 on broadcast dimensions). */
export function paramsFor(biasShape = SHAPES.bias) {
  const words = new Uint32Array(PARAMS);
  if (!SPEC.bias) return words;
  const full = SHAPES.bias;
  if (!Array.isArray(biasShape) || biasShape.length !== 4 || biasShape[3] !== full[3]
      || biasShape.slice(0, 3).some((n, i) => n !== 1 && n !== full[i])) {
    throw new Error(`biasShape=${JSON.stringify(biasShape)}: expected [B|1, Nq|1, S|1, ${full[3]}]`);
  }
  const [bb, nb, sb, c] = biasShape;
  words[PARAM_WORDS.bias_ss] = sb > 1 ? c : 0;
  words[PARAM_WORDS.bias_sh] = nb > 1 ? sb * c : 0;
  words[PARAM_WORDS.bias_sb] = bb > 1 ? nb * sb * c : 0;
  return words;
}

function checkView(name, view, bytes) {
  if (!ArrayBuffer.isView(view)) throw new Error(`${name}: expected a typed array`);
  if (view.byteLength !== bytes) {
    throw new Error(`${name}: ${view.byteLength} bytes, expected ${bytes} (shape ${JSON.stringify(SHAPES[name])})`);
  }
}

/** Pipelines, the parameter block and scratch buffers for this spec, created once.
 *  Returns {dispatch(pass, buffers), run(inputs), setBiasShape(shape), destroy()}. */
export async function createAttention(device) {
  const U = GPUBufferUsage;
  const stages = [];
  for (const st of STAGES) {
    const bgl = device.createBindGroupLayout({entries: st.bindings.map(([binding, kind]) => ({
      binding, visibility: GPUShaderStage.COMPUTE, buffer: {type: BINDING_TYPES[kind]}}))});
    const module = device.createShaderModule({label: st.kernel, code: st.wgsl});
    const info = await module.getCompilationInfo();
    const errors = info.messages.filter((m) => m.type === 'error');
    if (errors.length) {
      throw new Error(`${st.kernel}: WGSL compile failed: ` + errors.map(
        (m) => `line ${m.lineNum}:${m.linePos}: ${m.message}`).join('; '));
    }
    const pipeline = await device.createComputePipelineAsync({label: st.kernel,
      layout: device.createPipelineLayout({bindGroupLayouts: [bgl]}),
      compute: {module, entryPoint: st.entryPoint}});
    stages.push({...st, bgl, pipeline});
  }
  const made = [];
  const buffer = (label, size, usage) => {
    const b = device.createBuffer({label, size: Math.max(16, align(size, 16)), usage});
    made.push(b);
    return b;
  };
  const own = {
    params: buffer('params', PARAMS.byteLength, U.UNIFORM | U.COPY_DST),
    o_parts: buffer('o_parts', BYTES.o_parts, U.STORAGE),
    lse_parts: buffer('lse_parts', BYTES.lse_parts, U.STORAGE),
    // Absent inputs bind a read-only stand-in, an absent lse a writable one.
    dummy_r: buffer('dummy_r', 16, U.STORAGE),
    dummy_w: buffer('dummy_w', 16, U.STORAGE),
  };
  const setBiasShape = (shape) => device.queue.writeBuffer(own.params, 0, paramsFor(shape));
  setBiasShape(SHAPES.bias);

  /** Record the stages into a compute pass; `bufs` holds GPUBuffers q, k, v, out and, as
   *  the spec needs them, bias (f32), seqlens_k (i32), head_sink (f32), kv_start (i32),
   *  seqlens_q (i32), lse (f32). */
  function dispatch(pass, bufs) {
    const pick = {
      params: own.params, q: bufs.q, k: bufs.k, v: bufs.v, out: bufs.out,
      k_scale: SPEC.kv_dtype ? bufs.k_scale : own.dummy_r,
      v_scale: SPEC.kv_dtype ? bufs.v_scale : own.dummy_r,
      bias: SPEC.bias ? bufs.bias : own.dummy_r,
      seqlens_k: SPEC.seqlens_k ? bufs.seqlens_k : own.dummy_r,
      head_sink: SPEC.head_sink ? bufs.head_sink : own.dummy_r,
      kv_start: SPEC.kv_start ? bufs.kv_start : own.dummy_r,
      seqlens_q: SPEC.seqlens_q ? bufs.seqlens_q : own.dummy_r,
      lse: SPEC.return_lse ? bufs.lse : own.dummy_w,
      o_parts: own.o_parts, lse_parts: own.lse_parts,
    };
    for (const st of stages) {
      const entries = st.bindings.map(([binding, , name]) => {
        if (!pick[name]) throw new Error(`dispatch: buffer ${name} is required`);
        return {binding, resource: {buffer: pick[name]}};
      });
      pass.setPipeline(st.pipeline);
      pass.setBindGroup(0, device.createBindGroup({layout: st.bgl, entries}));
      pass.dispatchWorkgroups(...st.grid);
    }
  }

  /** Upload typed arrays, run, read back: {out, lse?}. out is Float32Array (float32) or
   *  Uint16Array of f16 / bf16 bits (float16, bfloat16); lse Float32Array [B, Nq, S]. */
  async function run(inputs) {
    const names = ['q', 'k', 'v'];
    if (SPEC.bias) names.push('bias');
    if (SPEC.seqlens_k) names.push('seqlens_k');
    if (SPEC.head_sink) names.push('head_sink');
    if (SPEC.kv_start) names.push('kv_start');
    if (SPEC.seqlens_q) names.push('seqlens_q');
    if (SPEC.kv_dtype) names.push('k_scale', 'v_scale');
    const temp = [];
    const bufs = {};
    for (const name of names) {
      let view = inputs[name];
      const shape = name === 'bias' && inputs.biasShape ? inputs.biasShape : SHAPES[name];
      checkView(name, view, product(shape) * BYTES_PER_ELEMENT[name]);
      if (view.byteLength % 4) {       // writeBuffer moves whole 4-byte words
        const padded = new Uint8Array(align(view.byteLength, 4));
        padded.set(new Uint8Array(view.buffer, view.byteOffset, view.byteLength));
        view = padded;
      }
      const b = device.createBuffer({label: name, size: Math.max(16, align(view.byteLength, 16)),
        usage: U.STORAGE | U.COPY_DST});
      device.queue.writeBuffer(b, 0, view.buffer, view.byteOffset, view.byteLength);
      temp.push(b);
      bufs[name] = b;
    }
    const outs = [['out', BYTES.out]];
    if (SPEC.return_lse) outs.push(['lse', BYTES.lse]);
    const read = {};
    for (const [name, bytes] of outs) {
      bufs[name] = device.createBuffer({label: name, size: align(bytes, 16), usage: U.STORAGE | U.COPY_SRC});
      read[name] = device.createBuffer({label: `read ${name}`, size: align(bytes, 16), usage: U.MAP_READ | U.COPY_DST});
      temp.push(bufs[name], read[name]);
    }
    if (SPEC.bias) setBiasShape(inputs.biasShape || SHAPES.bias);
    const enc = device.createCommandEncoder();
    const pass = enc.beginComputePass();
    dispatch(pass, bufs);
    pass.end();
    for (const [name, bytes] of outs) enc.copyBufferToBuffer(bufs[name], 0, read[name], 0, align(bytes, 4));
    device.queue.submit([enc.finish()]);
    const result = {};
    for (const [name, bytes] of outs) {
      await read[name].mapAsync(GPUMapMode.READ);
      const copy = read[name].getMappedRange().slice(0, bytes);
      read[name].unmap();
      result[name] = name === 'out' && SPEC.dtype !== 'float32' ? new Uint16Array(copy) : new Float32Array(copy);
    }
    temp.forEach((b) => b.destroy());
    return result;
  }

  return {dispatch, run, setBiasShape, destroy: () => made.forEach((b) => b.destroy())};
}
