// kiln serve's page: the models served, a chat that streams, a form for encoder models and live
// figures from /metrics. Everything it shows comes from the server's own API; with --api-key it
// sends the key typed in the header as a Bearer token. Answers are written as text, never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "kiln-api-key"; // sessionStorage: kept while the tab lives
const POINTS = 60; // seconds of history in each sparkline
const INFERENCE_ROUTES = new Set(["infer", "predict", "embeddings", "completions", "chat_completions",
  "responses", "generate", "generate_stream"]); // kiln_requests_total's route label; not /metrics itself
const state = { models: [], history: [], abort: null, last: null, paused: false };

// --- API calls -----------------------------------------------------------------------------------

function headers(json) {
  const h = {};
  const key = sessionStorage.getItem(KEY);
  if (key) h.Authorization = "Bearer " + key;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

async function api(path, body, signal) {
  const init = body === undefined ? { headers: headers(false) }
    : { method: "POST", headers: headers(true), body: JSON.stringify(body), signal };
  const response = await fetch(path, init);
  if (!response.ok) throw await apiError(response);
  return response;
}

async function apiError(response) {
  let message = response.statusText;
  try {
    const body = await response.json(); // kiln's {"error": "..."} or OpenAI's {"error": {"message": ...}}
    message = typeof body.error === "string" ? body.error : (body.error && body.error.message) || message;
  } catch (_) { /* not JSON */ }
  if (response.status === 401) needKey(true);
  const error = new Error(`${response.status}: ${message}`);
  error.status = response.status;
  return error;
}

function needKey(missing) { // a 401 pauses the figures until a key is given
  $("key-note").hidden = !missing;
  state.paused = missing;
  if (missing) $("api-key").focus();
  else say("live-status", "");
}

function say(id, text, isError) {
  $(id).textContent = text;
  $(id).classList.toggle("error", Boolean(isError));
}

function element(tag, className, text) {
  const e = document.createElement(tag);
  if (className) e.className = className;
  if (text !== undefined) e.textContent = text;
  return e;
}

// --- models --------------------------------------------------------------------------------------

async function loadModels() {
  say("models-status", "");
  try {
    const list = await (await api("/v1/models")).json();
    state.models = await Promise.all(list.data.map(async ({ id }) => {
      try {
        const meta = await (await api(`/v2/models/${encodeURIComponent(id)}`)).json();
        return { name: id, task: meta.parameters.task, params: meta.parameters, outputs: meta.outputs };
      } catch (err) {
        return { name: id, task: "unavailable", params: {}, outputs: [], error: err.message };
      }
    }));
    const server = await (await api("/v2")).json();
    $("server-version").textContent = `${server.name} ${server.version}`;
  } catch (err) {
    say("models-status", err.message, true);
    return;
  }
  showModels();
}

function sizeOf(model) {
  if (model.params.max_context) return `${model.params.max_context} context`;
  const out = model.outputs.find((o) => o.name === "EMBEDDINGS");
  if (out) return `${out.shape[out.shape.length - 1]} dimensions`;
  const probabilities = model.outputs.find((o) => o.name === "PROBABILITIES");
  if (probabilities) return `${probabilities.shape[probabilities.shape.length - 1]} labels`;
  return model.params.max_length ? `${model.params.max_length} tokens` : "";
}

function showModels() {
  const rows = state.models.map((m) => {
    const row = element("tr");
    for (const text of [m.name, m.error || m.task, m.params.variant || "", sizeOf(m)]) row.append(element("td", "", text));
    return row;
  });
  $("models-body").replaceChildren(...rows);
  const generators = state.models.filter((m) => m.task === "text-generation");
  const encoders = state.models.filter((m) => m.task !== "text-generation" && m.task !== "unavailable");
  fillSelect("chat-model", generators);
  fillSelect("encode-model", encoders);
  $("chat-none").hidden = generators.length > 0;
  $("chat-form").hidden = generators.length === 0;
  $("encode-none").hidden = encoders.length > 0;
  $("encode-form").hidden = encoders.length === 0;
  showQuestion();
}

function fillSelect(id, models) {
  const chosen = $(id).value;
  $(id).replaceChildren(...models.map((m) => new Option(`${m.name} (${m.task})`, m.name)));
  if (models.some((m) => m.name === chosen)) $(id).value = chosen;
}

// --- chat ----------------------------------------------------------------------------------------

function addMessage(role, text) {
  const bubble = element("div", `msg ${role}`, text);
  $("chat-log").append(bubble);
  $("chat-log").scrollTop = $("chat-log").scrollHeight;
  return bubble;
}

// The data of each server-sent event, parsed, until [DONE].
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

function chatRequest(text) {
  const messages = [];
  const system = $("chat-system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history, { role: "user", content: text });
  const body = { model: $("chat-model").value, messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("chat-temperature").value), max_tokens: Number($("chat-max-tokens").value) };
  const schema = $("chat-schema").value.trim();
  if (schema) {
    let parsed;
    try { parsed = JSON.parse(schema); } catch (err) { throw new Error(`the JSON schema is not JSON: ${err.message}`); }
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: parsed } };
  }
  return body;
}

async function sendChat(event) {
  event.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text || state.abort) return;
  let body;
  try { body = chatRequest(text); } catch (err) { say("chat-status", err.message, true); return; }
  addMessage("user", text);
  const bubble = addMessage("assistant", "");
  $("chat-input").value = "";
  state.abort = new AbortController();
  busy(true);
  const started = performance.now();
  let first = 0, answer = "", usage = null, finish = "";
  try {
    const response = await api("/v1/chat/completions", body, state.abort.signal);
    for await (const chunk of sseEvents(response)) {
      if (chunk.error) throw new Error(chunk.error.message || String(chunk.error));
      if (chunk.usage) usage = chunk.usage;
      const choice = (chunk.choices || [])[0];
      if (!choice) continue;
      const piece = (choice.delta && choice.delta.content) || "";
      if (piece) {
        first = first || performance.now();
        answer += piece;
        bubble.textContent = answer;
        $("chat-log").scrollTop = $("chat-log").scrollHeight;
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    state.history.push({ role: "user", content: text }, { role: "assistant", content: answer });
    const seconds = (performance.now() - (first || started)) / 1000;
    const tokens = usage ? usage.completion_tokens : 0;
    const figures = [`${tokens} tokens`, first ? `first after ${Math.round(first - started)} ms` : "",
      tokens > 1 && seconds > 0 ? `${((tokens - 1) / seconds).toFixed(1)} tokens/s` : "", finish && `finish: ${finish}`];
    bubble.append(element("span", "meta", figures.filter(Boolean).join(" · ")));
    say("chat-status", "");
  } catch (err) {
    const stopped = err.name === "AbortError";
    bubble.classList.toggle("error", !stopped);
    if (!answer) bubble.textContent = stopped ? "(stopped)" : err.message;
    say("chat-status", stopped ? "stopped" : err.message, !stopped);
  } finally {
    state.abort = null;
    busy(false);
  }
}

function busy(on) {
  $("chat-send").disabled = on;
  $("chat-stop").disabled = !on;
  say("chat-status", on ? "answering…" : $("chat-status").textContent);
}

// --- encoders ------------------------------------------------------------------------------------

function chosenEncoder() {
  return state.models.find((m) => m.name === $("encode-model").value);
}

function showQuestion() {
  const model = chosenEncoder();
  $("encode-question-label").hidden = !model || model.task !== "question-answering";
}

async function runEncoder(event) {
  event.preventDefault();
  const model = chosenEncoder();
  const text = $("encode-text").value;
  const out = $("encode-result");
  if (!model) return;
  say("encode-status", "running…");
  try {
    if (model.task === "sentence-embeddings") {
      const answer = await (await api("/v1/embeddings", { model: model.name, input: text })).json();
      const vector = answer.data[0].embedding;
      const norm = Math.sqrt(vector.reduce((sum, v) => sum + v * v, 0));
      out.replaceChildren(
        element("p", "", `${vector.length} dimensions · norm ${norm.toFixed(4)} · ${answer.usage.prompt_tokens} tokens`),
        element("p", "vector", `[${vector.slice(0, 8).map((v) => v.toFixed(5)).join(", ")}, …]`));
    } else {
      const inputs = model.task === "question-answering" ? { question: $("encode-question").value, context: text } : text;
      const answer = await (await api(`/v2/models/${encodeURIComponent(model.name)}/predict`, { inputs })).json();
      out.replaceChildren(...(model.task === "text-classification" ? scores(answer)
        : [element("pre", "", JSON.stringify(answer, null, 2))]));
    }
    say("encode-status", "");
  } catch (err) {
    out.replaceChildren();
    say("encode-status", err.message, true);
  }
}

function scores(ranked) {
  return ranked.map(({ label, score }) => {
    const row = element("div", "score");
    const bar = element("div", "bar");
    bar.style.width = `${Math.max(1, score * 100).toFixed(1)}%`;
    const track = element("div");
    track.append(bar);
    row.append(element("span", "", label), track, element("span", "", score.toFixed(4)));
    return row;
  });
}

// --- live figures from /metrics ------------------------------------------------------------------

const figures = Object.fromEntries(["rps", "tps", "queue", "kv"].map((id) => {
  const figure = $(`fig-${id}`);
  return [id, { canvas: figure.querySelector("canvas"), output: figure.querySelector("output"), values: [] }];
}));

// Prometheus' text format: one sample a line, `name{label="value",...} number`.
function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    const m = /^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
    if (!m) continue;
    const labels = {};
    for (const [, name, value] of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[name] = value;
    samples.push({ name: m[1], labels, value: Number(m[3]) });
  }
  return samples;
}

function sum(samples, name, keep) {
  return samples.filter((s) => s.name === name && (!keep || keep(s.labels))).reduce((a, s) => a + s.value, 0);
}

function plot(id, value, text) {
  const figure = figures[id];
  figure.values.push(value);
  if (figure.values.length > POINTS) figure.values.shift();
  figure.output.textContent = text;
  figure.canvas.setAttribute("aria-label", `${figure.canvas.getAttribute("aria-label").split(":")[0]}: ${text}`);
  figure.canvas.dataset.values = figure.values.join(","); // read by the tests
  draw(figure);
}

function draw({ canvas, values }) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const top = Math.max(1e-9, ...values);
  const step = width / (Math.max(values.length, POINTS / 3) - 1); // a minute once full, at least 20 s wide
  const x = (i) => width - (values.length - 1 - i) * step;
  const y = (v) => height - 2 - (v / top) * (height - 6);
  ctx.beginPath();
  values.forEach((v, i) => (i ? ctx.lineTo(x(i), y(v)) : ctx.moveTo(x(i), y(v))));
  ctx.strokeStyle = getComputedStyle(canvas).color;
  ctx.lineWidth = 1.5;
  ctx.stroke();
  ctx.lineTo(x(values.length - 1), height);
  ctx.lineTo(x(0), height);
  ctx.globalAlpha = 0.15;
  ctx.fillStyle = ctx.strokeStyle;
  ctx.fill();
  ctx.globalAlpha = 1;
}

async function pollMetrics() {
  if (state.paused) return;
  try {
    const samples = parseMetrics(await (await api("/metrics")).text());
    const now = performance.now() / 1000;
    const counts = { requests: sum(samples, "kiln_requests_total", (l) => INFERENCE_ROUTES.has(l.route)),
      tokens: sum(samples, "vllm:generation_tokens_total") };
    if (state.last) {
      const seconds = now - state.last.time;
      const rps = Math.max(0, counts.requests - state.last.requests) / seconds;
      const tps = Math.max(0, counts.tokens - state.last.tokens) / seconds;
      plot("rps", rps, rps.toFixed(1));
      plot("tps", tps, tps.toFixed(1));
    }
    state.last = { time: now, ...counts };
    const waiting = sum(samples, "kiln_queue_inputs") + sum(samples, "vllm:num_requests_waiting");
    const running = sum(samples, "vllm:num_requests_running");
    plot("queue", waiting, `${waiting} waiting · ${running} running`);
    const kv = Math.max(0, ...samples.filter((s) => s.name === "vllm:kv_cache_usage_perc").map((s) => s.value * 100));
    const hasKv = samples.some((s) => s.name === "vllm:kv_cache_usage_perc");
    plot("kv", kv, hasKv ? `${kv.toFixed(kv < 1 ? 2 : 1)}%` : "no generation model");
    say("live-status", "");
  } catch (err) {
    say("live-status", err.message, true);
  }
}

// --- wiring --------------------------------------------------------------------------------------

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("api-key").value.trim());
  needKey(false);
  loadModels();
});
$("api-key").value = sessionStorage.getItem(KEY) || "";
$("models-refresh").addEventListener("click", loadModels);
$("chat-form").addEventListener("submit", sendChat);
$("chat-input").addEventListener("keydown", (event) => {
  if (event.key !== "Enter" || event.shiftKey) return;
  event.preventDefault();
  $("chat-form").requestSubmit();
});
$("chat-stop").addEventListener("click", () => state.abort && state.abort.abort());
$("chat-clear").addEventListener("click", () => { state.history = []; $("chat-log").replaceChildren(); });
$("encode-form").addEventListener("submit", runEncoder);
$("encode-model").addEventListener("change", showQuestion);
loadModels();
(async function poll() { // one call at a time: the next a second after the last answered
  await pollMetrics();
  setTimeout(poll, 1000);
})();
