// petrel chat page: plain JS, no build step. Talks to GET /v1/models, GET /model_info (does the model take images?)
// and POST /v1/chat/completions (stream: true). Message content is built by content.js (PetrelContent).
"use strict";

const STORE = "petrel-chat";
const $ = (id) => document.getElementById(id);
const els = {
  model: $("model"), temperature: $("temperature"), maxTokens: $("max-tokens"), apiKey: $("api-key"),
  system: $("system"), status: $("status"), log: $("log"), composer: $("composer"), input: $("input"),
  send: $("send"), stop: $("stop"), clear: $("clear"), attach: $("attach"), imageFile: $("image-file"),
  attachments: $("attachments"),
};
const { userContent, contentText, contentImages, takesImages } = globalThis.PetrelContent;

// conversation: [{role, content, stats?, error?}]; settings are kept with it (the API key only per tab)
let state = { messages: [], settings: {} };
let controller = null;
let attached = [];   // images for the next message: [{name, url}] (url: a data: URL)

function load() {
  try { state = Object.assign(state, JSON.parse(localStorage.getItem(STORE) || "{}")); } catch (_) { /* fresh */ }
  const s = state.settings;
  if (s.temperature !== undefined) els.temperature.value = s.temperature;
  if (s.maxTokens !== undefined) els.maxTokens.value = s.maxTokens;
  if (s.system !== undefined) els.system.value = s.system;
  els.apiKey.value = sessionStorage.getItem(STORE + "-key") || "";
}

function save() {
  state.settings = { temperature: els.temperature.value, maxTokens: els.maxTokens.value,
                     system: els.system.value, model: els.model.value || state.settings.model };
  sessionStorage.setItem(STORE + "-key", els.apiKey.value);
  try {
    localStorage.setItem(STORE, JSON.stringify({ messages: state.messages, settings: state.settings }));
  } catch (_) {  // over the storage quota (images are large): the conversation lives on in this tab only
    setStatus("This conversation is too large to keep after a reload (attached images).");
  }
}

function headers() {
  const h = { "Content-Type": "application/json" };
  if (els.apiKey.value.trim()) h["Authorization"] = "Bearer " + els.apiKey.value.trim();
  return h;
}

function setStatus(text) { els.status.textContent = text; }

function bubble(msg) {
  const div = document.createElement("div");
  div.className = "msg " + msg.role + (msg.error ? " error" : "");
  const role = document.createElement("span");
  role.className = "role";
  role.textContent = msg.role === "user" ? "You" : "Assistant";
  const images = document.createElement("span");
  images.className = "images";
  for (const url of contentImages(msg.content)) {
    const img = document.createElement("img");
    img.src = url;
    img.alt = "attached image";
    images.append(img);
  }
  const text = document.createElement("span");
  text.className = "text";
  text.textContent = msg.error ? contentText(msg.content) + "\n" + msg.error : contentText(msg.content);
  const stats = document.createElement("span");
  stats.className = "stats";
  stats.textContent = msg.stats ? "\n" + msg.stats : "";
  div.append(role, ...(images.childElementCount ? [images] : []), text, stats);
  els.log.append(div);
  return { div, text, stats };
}

function render() {
  els.log.replaceChildren();
  state.messages.forEach(bubble);
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    return `HTTP ${resp.status}: ${(body.error && body.error.message) || JSON.stringify(body)}`;
  } catch (_) {
    return `HTTP ${resp.status} ${resp.statusText}`;
  }
}

async function loadModels() {
  try {
    const resp = await fetch("/v1/models", { headers: headers() });
    if (!resp.ok) { setStatus("Could not list models: " + await errorText(resp)); return; }
    const data = (await resp.json()).data || [];
    els.model.replaceChildren(...data.map((m) => new Option(m.id, m.id)));
    if (state.settings.model && data.some((m) => m.id === state.settings.model)) els.model.value = state.settings.model;
    setStatus(data.length ? "Ready." : "The server lists no models.");
    await loadModelInfo();
  } catch (err) {
    setStatus("Could not reach the server: " + err.message);
  }
}

// The attach button shows only when the served model takes images.
async function loadModelInfo() {
  let images = false;
  try {
    const resp = await fetch("/model_info", { headers: headers() });
    images = resp.ok && takesImages(await resp.json());
  } catch (_) { /* an older server: no images */ }
  els.attach.hidden = !images;
  if (!images) { attached = []; renderAttachments(); }
}

function renderAttachments() {
  els.attachments.replaceChildren(...attached.map((image, i) => {
    const chip = document.createElement("span");
    chip.className = "attachment";
    const img = document.createElement("img");
    img.src = image.url;
    img.alt = image.name;
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "×";
    remove.setAttribute("aria-label", "Remove " + image.name);
    remove.addEventListener("click", () => { attached.splice(i, 1); renderAttachments(); });
    chip.append(img, document.createTextNode(image.name), remove);
    return chip;
  }));
  els.attachments.hidden = attached.length === 0;
}

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attachFiles(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) { setStatus(`${file.name} is not an image.`); continue; }
    try {
      attached.push({ name: file.name, url: await readAsDataUrl(file) });
    } catch (err) {
      setStatus(`Could not read ${file.name}: ${err.message}`);
    }
  }
  renderAttachments();
}

// Split a server-sent-events byte stream into the payloads of its `data:` lines.
async function* sseData(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let nl;
    while ((nl = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, nl).replace(/\r$/, "");
      buffer = buffer.slice(nl + 1);
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data && data !== "[DONE]") yield data;
    }
  }
}

async function send(text) {
  const content = userContent(text, attached.map((image) => image.url));
  attached = [];
  renderAttachments();
  const history = state.messages.filter((m) => !m.error).map((m) => ({ role: m.role, content: m.content }));
  const system = els.system.value.trim();
  const messages = (system ? [{ role: "system", content: system }] : []).concat(history, [{ role: "user", content }]);
  state.messages.push({ role: "user", content });
  bubble(state.messages[state.messages.length - 1]);
  const reply = { role: "assistant", content: "" };
  const view = bubble(reply);
  const conversation = state.messages;   // Clear replaces it: a reply then belongs to no conversation
  save();

  const body = { model: els.model.value, messages, stream: true, stream_options: { include_usage: true } };
  const temperature = parseFloat(els.temperature.value);
  const maxTokens = parseInt(els.maxTokens.value, 10);
  if (!Number.isNaN(temperature)) body.temperature = temperature;
  if (!Number.isNaN(maxTokens)) body.max_tokens = maxTokens;

  controller = new AbortController();
  els.send.disabled = true; els.stop.disabled = false;
  setStatus("Generating…");
  const start = performance.now();
  let first = null, chunks = 0, usage = null, finish = null;
  try {
    const resp = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body),
                                                        signal: controller.signal });
    if (!resp.ok) throw new Error(await errorText(resp));
    for await (const data of sseData(resp.body)) {
      const event = JSON.parse(data);
      if (event.error) throw new Error(event.error.message || JSON.stringify(event.error));
      if (event.usage) usage = event.usage;
      const choice = (event.choices || [])[0];
      if (!choice) continue;
      if (choice.finish_reason) finish = choice.finish_reason;
      const piece = choice.delta && choice.delta.content;
      if (piece) {
        if (first === null) first = performance.now();
        chunks += 1;
        reply.content += piece;
        view.text.textContent = reply.content;
      }
    }
    setStatus("Ready.");
  } catch (err) {
    if (err.name === "AbortError") { finish = "stopped"; setStatus("Stopped."); }
    else { reply.error = err.message; view.div.classList.add("error"); view.text.textContent = reply.content + "\n" + err.message; setStatus("Error."); }
  } finally {
    const end = performance.now();
    const tokens = usage ? usage.completion_tokens : chunks;
    const parts = [];
    if (first !== null) {
      parts.push(`TTFT ${((first - start) / 1000).toFixed(2)} s`);
      const decode = (end - first) / 1000;
      if (tokens > 1 && decode > 0) parts.push(`${((tokens - 1) / decode).toFixed(1)} tokens/s`);
    }
    parts.push(`${tokens} tokens`);
    if (finish) parts.push(finish);
    reply.stats = parts.join(" · ");
    view.stats.textContent = "\n" + reply.stats;
    if (state.messages === conversation) conversation.push(reply);
    save();
    controller = null;
    els.send.disabled = false; els.stop.disabled = true;
  }
}

els.composer.addEventListener("submit", (e) => {
  e.preventDefault();
  const content = els.input.value.trim();
  if (!content || controller) return;
  els.input.value = "";
  send(content);
});
els.input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); els.composer.requestSubmit(); }
});
els.stop.addEventListener("click", () => { if (controller) controller.abort(); });
els.clear.addEventListener("click", () => {
  if (controller) controller.abort();
  state.messages = [];
  save();
  render();
  setStatus("Conversation cleared.");
});
els.attach.addEventListener("click", () => els.imageFile.click());
els.imageFile.addEventListener("change", async () => {
  await attachFiles(Array.from(els.imageFile.files));
  els.imageFile.value = "";   // the same file may be attached again
});
for (const el of [els.temperature, els.maxTokens, els.system, els.model]) el.addEventListener("change", save);
els.apiKey.addEventListener("change", () => { save(); loadModels(); });

load();
render();
loadModels();
