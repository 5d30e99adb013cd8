// engine console: a chat playground over /v1/chat/completions and a live view of /v1/engine/status.
// No framework, no build step; it reads only what /v1/* answers, sending the API key the user gives it.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { key: sessionStorage.getItem("engine-api-key") || "", history: [], controller: null, timer: null };

function headers(json) {
  const h = json ? { "Content-Type": "application/json" } : {};
  if (state.key) h.Authorization = "Bearer " + state.key;
  return h;
}

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

function setServerState(text, kind) {
  const pill = $("server-state");
  pill.textContent = text;
  pill.className = "pill " + (kind || "");
}

async function api(path, options) {
  const response = await fetch(path, { ...options, headers: headers(options && options.body) });
  if (response.status === 401) {
    $("key-form").hidden = false;
    setServerState("API key needed", "bad");
    throw new Error("this server needs its API key: enter it above");
  }
  return response;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (e) {
    return response.status + " " + response.statusText;
  }
}

// ---- playground --------------------------------------------------------------------------------
async function loadModels() {
  const response = await api("/v1/models");
  if (!response.ok) throw new Error(await errorText(response));
  const select = $("model");
  const chosen = select.value;
  select.replaceChildren();
  for (const model of (await response.json()).data) {
    const label = model.parent ? model.id + " (LoRA on " + model.parent + ")" : model.id;
    select.append(el("option", { value: model.id }, label));
  }
  if (chosen) select.value = chosen;
}

function addMessage(role, text) {
  const box = el("div", { class: "msg " + role });
  box.append(el("span", { class: "role" }, role));
  const body = el("div", { class: "body" }, text || "");
  box.append(body);
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function tokenSpan(entry) {
  const alternatives = (entry.top_logprobs || [])
    .map((t) => JSON.stringify(t.token) + " " + t.logprob.toFixed(3))
    .join("\n");
  const title = "logprob " + entry.logprob.toFixed(3) + " (p " + Math.exp(entry.logprob).toFixed(3) + ")" +
    (alternatives ? "\ntop:\n" + alternatives : "");
  return el("span", { class: "tok", title: title, tabindex: "0" }, entry.token);
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history);
  const body = {
    model: $("model").value || undefined,
    messages: messages,
    stream: true,
    stream_options: { include_usage: true },
    logprobs: true,
    top_logprobs: 5,
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  const stops = $("stop-words").value.split("\n").filter((s) => s.length);
  if (stops.length) body.stop = stops;
  const schema = $("schema").value.trim();
  if (schema) {
    let parsed;
    try {
      parsed = JSON.parse(schema);
    } catch (e) {
      throw new Error("the JSON schema does not parse: " + e.message);
    }
    body.response_format = { type: "json_schema", json_schema: { name: "console", schema: parsed } };
  }
  return body;
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  let body;
  try {
    state.history.push({ role: "user", content: text });
    body = requestBody();
  } catch (e) {
    state.history.pop();
    $("chat-status").textContent = e.message;
    return;
  }
  addMessage("user", text);
  $("prompt").value = "";
  const box = addMessage("assistant", "");
  const answer = box.querySelector(".body");
  let reasoning = null;
  let content = "";
  state.controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  $("chat-status").textContent = "generating…";
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", body: JSON.stringify(body), signal: state.controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let usage = null;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const line = buffer.slice(0, cut).trim();
        buffer = buffer.slice(cut + 2);
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const chunk = JSON.parse(line.slice(6));
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) continue;
        const delta = choice.delta || {};
        if (delta.reasoning_content) {
          if (!reasoning) {
            reasoning = el("details", {});
            reasoning.append(el("summary", {}, "Reasoning"), el("div", {}));
            box.insertBefore(reasoning, answer);
          }
          reasoning.lastChild.textContent += delta.reasoning_content;
        }
        const tokens = choice.logprobs && choice.logprobs.content;
        if (delta.content) {
          content += delta.content;
          if (tokens && tokens.map((t) => t.token).join("") === delta.content) {
            for (const entry of tokens) answer.append(tokenSpan(entry));
          } else {
            answer.append(document.createTextNode(delta.content));
          }
        }
        if (delta.tool_calls) answer.append(document.createTextNode(JSON.stringify(delta.tool_calls)));
      }
      box.scrollIntoView({ block: "end" });
    }
    state.history.push({ role: "assistant", content: content });
    $("chat-status").textContent = usage
      ? "done: " + usage.prompt_tokens + " prompt + " + usage.completion_tokens + " output tokens"
      : "done";
  } catch (e) {
    if (e.name === "AbortError") {
      state.history.push({ role: "assistant", content: content });
      $("chat-status").textContent = "stopped";
    } else {
      state.history.pop();
      box.classList.add("error");
      answer.textContent = e.message;
      $("chat-status").textContent = "failed";
    }
  } finally {
    state.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

// ---- live view ---------------------------------------------------------------------------------
function fixed(value, digits) {
  return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
}

function polyline(points, key, maxValue, cls) {
  if (!points.length) return null;
  const span = Math.max(1, -points[0].t);
  const coords = points.map((p) => {
    const x = 300 * (1 - -p.t / span);
    const y = 98 - 94 * (p[key] / maxValue);
    return x.toFixed(1) + "," + y.toFixed(1);
  });
  const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
  line.setAttribute("points", coords.join(" "));
  line.setAttribute("class", cls);
  return line;
}

function drawChart(history) {
  const svg = $("chart");
  svg.replaceChildren();
  $("chart-span").textContent = history.length ? Math.round(-history[0].t) : 0;
  const stepMax = Math.max(1, ...history.map((p) => p.mean_step_ms));
  const batchMax = Math.max(1, ...history.map((p) => p.mean_batch_size));
  for (const line of [polyline(history, "mean_step_ms", stepMax, "step"), polyline(history, "mean_batch_size", batchMax, "batch")]) {
    if (line) svg.append(line);
  }
}

function fillTable(id, rows) {
  const body = $(id).querySelector("tbody");
  body.replaceChildren();
  for (const cells of rows) {
    const tr = el("tr", {});
    for (const [text, cls] of cells) tr.append(el("td", cls ? { class: cls } : {}, String(text)));
    body.append(tr);
  }
}

function drawProducts(tables) {
  const box = $("products");
  const names = Object.keys(tables || {});
  if (!names.length) return;
  box.replaceChildren();
  box.classList.remove("muted");
  for (const name of names) {
    const table = tables[name];
    const section = el("details", {});
    const chosen = {};
    for (const row of table.table) chosen[row.chosen] = (chosen[row.chosen] || 0) + 1;
    section.append(el("summary", {}, name + " weights (" + table.key.isa + ", " + table.key.threads + " threads, " +
      (table.source === "measured" ? "measured at start-up" : "cached") + "): " +
      Object.entries(chosen).map(([k, n]) => k + " × " + n).join(", ")));
    const rates = new Set();
    for (const row of table.table) for (const k of Object.keys(row)) if (k.endsWith("_gflops")) rates.add(k);
    const grid = el("table", {});
    const head = el("tr", {});
    for (const h of ["shape", "rows", "chosen", ...[...rates].map((r) => r.replace("_gflops", " GFLOP/s"))]) {
      head.append(el("th", { scope: "col" }, h));
    }
    grid.append(el("thead", {}), el("tbody", {}));
    grid.firstChild.append(head);
    for (const row of table.table) {
      const tr = el("tr", {});
      for (const v of [row.shape, row.rows, row.chosen, ...[...rates].map((r) => (r in row ? row[r] : ""))]) {
        tr.append(el("td", {}, String(v)));
      }
      grid.lastChild.append(tr);
    }
    section.append(grid);
    box.append(section);
  }
}

async function refresh() {
  try {
    const response = await api("/v1/engine/status");
    if (!response.ok) {
      setServerState(await errorText(response), "bad");
      return;
    }
    const s = await response.json();
    setServerState(s.model + " · engine " + s.version, "ok");
    if (!$("model").options.length) loadModels().catch(() => {}); // the engine was still loading at first
    $("running").textContent = s.requests.running;
    $("waiting").textContent = s.requests.waiting;
    $("prompt-rate").textContent = fixed(s.rates.prompt_tokens_per_s, 1);
    $("output-rate").textContent = fixed(s.rates.generation_tokens_per_s, 1);
    $("kv-usage").textContent = fixed(100 * s.kv_cache.usage, 1) + "%";
    $("prefix-hits").textContent = fixed(100 * s.kv_cache.prefix_cache_hit_rate, 1) + "%";
    $("step-ms").textContent = fixed(s.rates.mean_step_ms, 1) + " ms";
    $("batch").textContent = fixed(s.rates.mean_batch_size, 1);
    $("spec").textContent = s.spec_decoding ? fixed(100 * s.spec_decoding.acceptance_rate, 1) + "%" : "off";
    $("generated").textContent = s.totals.generated_tokens;
    $("shadow-card").hidden = !s.shadow;
    if (s.shadow) $("shadow").textContent = s.shadow.verdict + " · speed " + s.shadow.speed_verdict;
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
    drawChart(s.history);
    fillTable("ranks", s.dp_ranks.map((r) => [
      [r.dp_rank === null ? "all" : r.dp_rank], [r.running], [r.waiting], [fixed(100 * r.kv_cache_usage, 1) + "%"],
      [fixed(100 * r.prefix_cache_hit_rate, 1) + "%"], [r.requests_received],
    ]));
    fillTable("plugins", s.plugins.map((p) => [
      [p.kind], [p.chosen], [p.source + " (contract " + p.contract + ")"], [p.why],
      [p.others.map((o) => o.name + (o.available ? ": available" : ": " + o.reason)).join("\n"), "reasons"],
    ]));
    drawProducts(s.product_tables);
  } catch (e) {
    setServerState(e.message, "bad");
  }
}

function schedule() {
  clearTimeout(state.timer);
  state.timer = setTimeout(async () => {
    if (!document.hidden) await refresh();
    schedule();
  }, 1000);
}

// ---- wiring ------------------------------------------------------------------------------------
$("chat-form").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("chat-form").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("clear").addEventListener("click", () => {
  state.history = [];
  $("messages").replaceChildren();
  $("chat-status").textContent = "";
});
$("key-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  state.key = $("api-key").value.trim();
  sessionStorage.setItem("engine-api-key", state.key);
  $("key-form").hidden = true;
  await start();
});

async function start() {
  try {
    await loadModels();
  } catch (e) {
    setServerState(e.message, "bad");
  }
  await refresh();
  schedule();
}

start();
