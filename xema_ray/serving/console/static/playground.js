// Playground: pick a model and template, generate an image or run a video job (progress, cancel).
// Reference images and adapters appear only when this deployment's API offers them (its OpenAPI document).
"use strict";
const state = { models: [], templates: [], features: { edits: false, videoRefs: false, adapters: false }, adapters: [], job: null, blobUrl: null };

function setStatus(text, error = false) { const s = $("#status"); s.textContent = text; s.classList.toggle("error", error); }

async function detectFeatures() {
  let doc = null;
  try { doc = await api("/openapi.json"); } catch (_) { return; }
  const paths = doc.paths || {};
  state.features.edits = !!(paths["/v1/images/edits"] && paths["/v1/images/edits"].post);
  state.features.adapters = !!(paths["/v1/adapters"] && paths["/v1/adapters"].get);
  const schemas = (doc.components && doc.components.schemas) || {};
  const ref = schemas.VideoCreate && schemas.VideoCreate.properties && schemas.VideoCreate.properties.input_reference;
  state.features.videoRefs = !!ref && !/not supported/i.test(ref.description || "");
}

async function loadAdapters() {
  state.adapters = [];
  if (!state.features.adapters) return;
  try {
    const got = await api("/v1/adapters");
    state.adapters = Array.isArray(got) ? got : (got && got.data) || [];
  } catch (_) { state.adapters = []; }
}

function current() {
  const key = $("#template").value;
  return state.templates.find((t) => t.template === key);
}
const kindOf = (model) => (state.models.find((m) => m.id === model) || {}).kind || "image";

function fillTemplates() {
  const model = $("#model").value, sel = $("#template");
  sel.replaceChildren();
  for (const t of state.templates.filter((t) => t.model === model)) {
    const shape = t.frames > 1 ? `${t.width}×${t.height}×${t.frames}` : `${t.width}×${t.height}`;
    sel.append(el("option", { value: t.template, text: `${shape} · ${t.steps} steps · ~${secs(t.predicted_latency_s)} · peak ${t.predicted_peak_gb.toFixed(2)} GB` }));
  }
  showTemplate();
}

function showTemplate() {
  const t = current();
  if (!t) return;
  $("#plan-line").textContent = `plan ${t.plan} · SLO ${secs(t.slo_s)}` + (t.options ? ` · options: ${t.options}` : "");
  const steps = $("#steps");
  steps.value = t.steps;
  steps.disabled = !t.steps_range;  // a template served at its own steps only, unless the API gives a range
  if (t.steps_range) { steps.min = t.steps_range[0]; steps.max = t.steps_range[1]; }
  const video = kindOf(t.model) === "video";
  $("#submit").textContent = video ? "Start video job" : "Generate image";
  // a template names how many reference images it takes (/v1/templates): the box is for those
  const refs = (t.references || 0) > 0 && (video ? state.features.videoRefs : state.features.edits);
  $("#refs-box").classList.toggle("hidden", !refs);
  $("#refs-note").textContent = video ? "image-to-video: the first frame" : "edit / reference (sent to /v1/images/edits)";
  const box = $("#adapters"), mine = state.adapters.filter((a) => !a.model || a.model === t.model);
  box.replaceChildren();
  $("#adapters-box").classList.toggle("hidden", !mine.length);
  for (const a of mine) {
    const id = "lora-" + a.name;
    box.append(el("div", { class: "row" },
      el("label", { for: id }, el("input", { type: "checkbox", id, "data-name": a.name }), " " + a.name),
      el("input", { type: "number", step: "0.1", value: "1.0", "data-scale": a.name, "aria-label": a.name + " scale" })));
  }
}

function lora() {
  return [...document.querySelectorAll("#adapters input[type=checkbox]:checked")].map((c) => ({
    name: c.dataset.name, scale: parseFloat($(`#adapters input[data-scale="${c.dataset.name}"]`).value) || 1.0 }));
}

// num_inference_steps when the template takes a range and another count was chosen
function stepsOf(t) {
  const n = parseInt($("#steps").value, 10);
  return t.steps_range && n && n !== t.steps ? n : undefined;
}

function seed() { const v = $("#seed").value; return v === "" ? undefined : parseInt(v, 10); }

function showImage(b64, meta) {
  if (state.blobUrl) URL.revokeObjectURL(state.blobUrl);
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  state.blobUrl = URL.createObjectURL(new Blob([bytes], { type: "image/png" }));
  const img = el("img", { src: state.blobUrl, alt: "generated image", id: "out-image" });
  const dl = el("a", { href: state.blobUrl, download: "xema.png", id: "download", text: "Download PNG" });
  $("#output").replaceChildren(img, el("div", { class: "meta", text: meta }), dl);
  $("#output").classList.remove("mute");
}

async function generateImage(t) {
  const started = performance.now();
  $("#job").classList.add("hidden");  // a previous video job's bar is not this image's
  const files = $("#refs").files;
  let r;
  if (state.features.edits && files && files.length) {
    const fd = new FormData();
    for (const f of files) fd.append("image", f);
    fd.append("prompt", $("#prompt").value); fd.append("model", t.model);
    fd.append("size", `${t.width}x${t.height}`); fd.append("response_format", "b64_json");
    if (seed() !== undefined) fd.append("seed", String(seed()));
    if (stepsOf(t) !== undefined) fd.append("num_inference_steps", String(stepsOf(t)));
    r = await api("/v1/images/edits", { method: "POST", body: fd });
  } else {
    const body = { model: t.model, prompt: $("#prompt").value, size: `${t.width}x${t.height}`, n: 1, response_format: "b64_json" };
    if (seed() !== undefined) body.seed = seed();
    if (stepsOf(t) !== undefined) body.num_inference_steps = stepsOf(t);
    if (lora().length) body.lora = lora();
    r = await api("/v1/images/generations", { method: "POST", body });
  }
  showImage(r.data[0].b64_json, `${t.template} · ${((performance.now() - started) / 1000).toFixed(2)} s in the browser`);
  setStatus("done");
}

function setProgress(pct, line) {
  const bar = $("#progress");
  bar.firstElementChild.style.width = pct + "%";
  bar.setAttribute("aria-valuenow", String(pct));
  $("#job-line").textContent = line;
}

async function startVideo(t) {
  const files = $("#refs").files;
  let job;
  const ref = state.features.videoRefs && files && files.length ? files[0] : null;
  if (ref && !lora().length) {  // as the openai client sends a file: multipart
    const fd = new FormData();
    fd.append("model", t.model); fd.append("prompt", $("#prompt").value); fd.append("size", `${t.width}x${t.height}`);
    fd.append("num_frames", String(t.frames)); fd.append("input_reference", files[0]);
    if (seed() !== undefined) fd.append("seed", String(seed()));
    if (stepsOf(t) !== undefined) fd.append("num_inference_steps", String(stepsOf(t)));
    job = await api("/v1/videos", { method: "POST", body: fd });
  } else {
    const body = { model: t.model, prompt: $("#prompt").value, size: `${t.width}x${t.height}`, num_frames: t.frames };
    if (seed() !== undefined) body.seed = seed();
    if (stepsOf(t) !== undefined) body.num_inference_steps = stepsOf(t);
    if (lora().length) body.lora = lora();  // a list: JSON only, so a first frame goes as a data URL
    if (ref) body.input_reference = await new Promise((ok, fail) => {
      const r = new FileReader(); r.onload = () => ok(r.result); r.onerror = () => fail(r.error); r.readAsDataURL(ref); });
    job = await api("/v1/videos", { method: "POST", body });
  }
  const total = stepsOf(t) || t.steps;
  state.job = { id: job.id, steps: total, cancelled: false };
  $("#job").classList.remove("hidden");
  $("#cancel").classList.remove("hidden");
  $("#output").replaceChildren(); $("#output").classList.add("mute");
  setProgress(0, `${job.id} · queued`);
  setStatus("video job running");
  while (state.job && !state.job.cancelled) {
    let v;
    try { v = await api(`/v1/videos/${job.id}`); } catch (e) { if (state.job && state.job.cancelled) break; throw e; }
    const step = Math.min(total, Math.round((v.progress / 100) * total));
    setProgress(v.progress, `${job.id} · ${v.status} · step ${step} of ${total} · ${v.progress}%`);
    if (v.status === "completed") { await showVideo(job.id, t); break; }
    if (v.status === "failed") throw new Error((v.error && v.error.message) || "the job failed");
    await new Promise((res) => setTimeout(res, 250));
  }
  $("#cancel").classList.add("hidden");
  state.job = null;
}

async function showVideo(id, t) {
  const r = await api(`/v1/videos/${id}/content`, { raw: true });
  const blob = await r.blob();
  if (state.blobUrl) URL.revokeObjectURL(state.blobUrl);
  state.blobUrl = URL.createObjectURL(blob);
  const video = el("video", { src: state.blobUrl, id: "out-video", controls: "", loop: "", autoplay: "", muted: "", playsinline: "" });
  video.muted = true;
  const dl = el("a", { href: state.blobUrl, download: `${id}.mp4`, id: "download", text: "Download MP4" });
  $("#output").replaceChildren(video, el("div", { class: "meta", text: `${t.template} · ${(blob.size / 1024).toFixed(0)} KiB` }), dl);
  $("#output").classList.remove("mute");
  setStatus("done");
}

async function cancelVideo() {
  if (!state.job) return;
  const id = state.job.id;
  state.job.cancelled = true;
  try {
    await api(`/v1/videos/${id}`, { method: "DELETE" });
    setProgress(parseInt($("#progress").getAttribute("aria-valuenow"), 10) || 0, `${id} · cancelled`);
    setStatus("cancelled");
  } catch (e) { setStatus("cancel failed: " + e.message, true); }
  $("#cancel").classList.add("hidden");
  $("#submit").disabled = false;
}

async function submit(ev) {
  ev.preventDefault();
  const t = current();
  if (!t) return;
  $("#submit").disabled = true;
  setStatus("working…");
  try {
    if (kindOf(t.model) === "video") await startVideo(t); else await generateImage(t);
  } catch (e) {
    setStatus(e.message, true);
    $("#cancel").classList.add("hidden");
    state.job = null;
  } finally { $("#submit").disabled = false; }
}

async function load() {
  try {
    await detectFeatures();
    const [models, templates] = await Promise.all([api("/v1/models"), api("/v1/templates"), loadAdapters()]);
    state.models = models.data; state.templates = templates;
    const sel = $("#model");
    sel.replaceChildren(...state.models.map((m) => el("option", { value: m.id, text: `${m.id} (${m.kind})` })));
    fillTemplates();
    setStatus("");
  } catch (e) {
    setStatus(e.status === 401 ? "this deployment needs an API key: enter it above" : e.message, true);
  }
}

setupHeader();
document.addEventListener("xema-key", load);
$("#model").addEventListener("change", fillTemplates);
$("#template").addEventListener("change", showTemplate);
$("#form").addEventListener("submit", submit);
$("#cancel").addEventListener("click", cancelVideo);
load();
