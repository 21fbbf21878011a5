// Runs an exported attention.js (served under /x/) the way a web app would: its own
// requestDevice() and createAttention(), inputs as typed arrays. The host sends the inputs
// as one binary job and gets {out, lse} back (wire.js framing), to compare with the reference.
import {describe, encode, nextJob, post, postJSON, query, reportErrors} from './wire.js';

async function main() {
  const hello = {mode: 'check'};
  let device = null;
  let mod = null;
  try {
    mod = await import(`/x/${query.get('module') || 'attention.js'}`);
    const adapter = await navigator.gpu.requestAdapter();
    if (!adapter) throw new Error('navigator.gpu.requestAdapter() returned null');
    Object.assign(hello, describe(adapter));
    device = await mod.requestDevice(adapter);
    hello.deviceFeatures = [...device.features].sort();
  } catch (e) {
    hello.error = String(e && e.message || e);
  }
  await postJSON('hello', hello);
  if (!device) return;
  for (;;) {
    const job = await nextJob();
    if (!job) return;
    let reply;
    try {
      const attn = await mod.createAttention(device);
      const inputs = Object.fromEntries(job.blobs);
      if (job.header.biasShape) inputs.biasShape = job.header.biasShape;
      const got = await attn.run(inputs);
      attn.destroy();
      reply = encode({id: job.header.id, ok: true}, Object.entries(got));
    } catch (e) {
      reply = encode({id: job.header.id, ok: false, error: String(e && e.stack || e)}, []);
    }
    await post('result', reply);
  }
}

reportErrors();
main();
