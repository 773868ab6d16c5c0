// specdec playground: talks only to this gateway's /playground/api (no other origin, no library).
"use strict";

const API = "/playground/api";
const $ = (sel, root = document) => root.querySelector(sel);
const el = (tag, attrs = {}, ...children) => {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
};
// A token as it is shown: whitespace made visible, so " the" and "the" differ on screen.
const show = (t) => (t === "" ? "∅" : t.replace(/ /g, "␣").replace(/\n/g, "↵"));
const pct = (x) => `${(100 * x).toFixed(1)}%`;

class ApiError extends Error {
  constructor(status, body) {
    super((body && body.error && body.error.message) || `HTTP ${status}`);
    this.status = status;
    this.body = body;
  }
}

// The caller's API token (when the orchestrator requires one): this tab's session storage only.
const TOKEN_KEY = "specdec-token";
function headers() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const h = { "Content-Type": "application/json" };
  if (token) h.Authorization = `Bearer ${token}`;
  return h;
}

async function post(path, body) {
  const reply = await fetch(API + path, {
    method: "POST", headers: headers(), body: JSON.stringify(body),
  });
  const data = await reply.json().catch(() => null);
  if (data && data.quota) showQuota(data.quota);
  if (!reply.ok) throw new ApiError(reply.status, data);
  return data;
}

// POST a generation and read its server-sent events: onRound(event) per round; returns `done`.
async function generate(body, onRound) {
  const reply = await fetch(API + "/generate", {
    method: "POST", headers: headers(), body: JSON.stringify(body),
  });
  if (!reply.ok) {
    const data = await reply.json().catch(() => null);
    if (data && data.quota) showQuota(data.quota);
    throw new ApiError(reply.status, data);
  }
  const reader = reply.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let done = null;
  for (;;) {
    const { value, done: end } = await reader.read();
    if (value) buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      let name = "message";
      const data = [];
      for (const line of block.split(/\r?\n/)) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
      }
      if (!data.length) continue;
      const event = JSON.parse(data.join("\n"));
      if (name === "round") onRound(event);
      else if (name === "done") done = event;
      else if (name === "error") throw new ApiError(event.status || 500, event);
    }
    if (end) break;
  }
  if (!done) throw new Error("the stream ended early");
  if (done.quota) showQuota(done.quota);
  return done;
}

// ------------------------------------------------------------------ quota and counters

function showQuota(q) {
  const node = $("#quota");
  if (q.remaining === null || q.remaining === undefined) {
    node.textContent = "Target passes: no quota on this gateway.";
    return;
  }
  const reset = q.reset_s ? ` (the oldest frees up in ${q.reset_s} s)` : "";
  node.textContent = `Target passes left this minute: ${q.remaining} of ${q.per_window}${reset}`;
  node.dataset.remaining = q.remaining;
}

// Each step's counters: this step's target passes and tokens, and its target-only twin.
function counters(box, labels = ["This step", "Target-only twin"]) {
  box.replaceChildren();
  const make = (cls, title) => {
    const fig = el("div", { class: `counter ${cls}`, role: "group", "aria-label": title });
    fig.append(el("h4", { text: title }));
    const dl = el("dl");
    for (const [key, name] of [["passes", "target passes"], ["tokens", "tokens"]]) {
      dl.append(el("dt", { text: name }), el("dd", { "data-counter": key, text: "0" }));
    }
    const note = el("p", { class: "note" });
    fig.append(dl, note);
    box.append(fig);
    return {
      set(passes, tokens, text = "") {
        $("[data-counter=passes]", fig).textContent = String(passes);
        $("[data-counter=tokens]", fig).textContent = String(tokens);
        note.textContent = text;
      },
    };
  };
  return { self: make("this", labels[0]), twin: make("twin", labels[1]) };
}

function status(section, message, kind = "info") {
  const node = [...section.querySelectorAll(".status")].pop();
  node.textContent = message;
  node.className = `status ${kind}`;
  node.setAttribute("role", kind.startsWith("error") ? "alert" : "status");
}

function fail(section, err) {
  if (err.status === 429) status(section, err.message, "error quota-error");
  else status(section, `Error: ${err.message}`, "error");
}

function charged(result) {
  return result.cached ? "from the cache: 0 passes charged" : `${result.charged} charged to your quota`;
}

// A token chip: kind is accepted / rejected / recovered / bonus / target / unused.
function chip(token, kind, extra = "") {
  const node = el("span", { class: `tok ${kind}`, title: `${kind} · id ${token.id}${extra}` });
  node.textContent = show(token.text);
  return node;
}

function equality(node, ids, twinIds) {
  const same = ids.length === twinIds.length && ids.every((t, i) => t === twinIds[i]);
  let first = 0;
  while (first < ids.length && ids[first] === twinIds[first]) first++;
  node.dataset.equal = String(same);
  node.className = `equality ${same ? "equal" : "differ"}`;
  node.textContent = same
    ? `Equal to one token per pass: yes, ${ids.length} of ${ids.length} tokens identical.`
    : `Equal to one token per pass: NO — first difference at token ${first + 1}.`;
  return same;
}

function busy(form, on) {
  for (const b of form.querySelectorAll("button")) b.disabled = on;
  form.setAttribute("aria-busy", String(on));
}

function bind(formSel, handler) {
  const form = $(formSel);
  const section = form.closest("section");
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    busy(form, true);
    status(section, "");
    try {
      await handler(section, form);
    } catch (err) {
      fail(section, err);
    } finally {
      busy(form, false);
    }
  });
}

const num = (sel) => Number($(sel).value);

// ------------------------------------------------------------------ 1. one token per pass

bind("#step1 form", async (section) => {
  const out = $("#step1-out");
  out.replaceChildren();
  const c = counters($(".counters", section), ["This step", "Target-only twin (the same: it is target-only)"]);
  const done = await generate(
    { prompt: $("#step1-prompt").value, proposer: "none", max_new_tokens: num("#step1-tokens") },
    (r) => {
      for (const t of r.committed) {
        out.append(el("span", { class: "pass" }, chip(t, "target"), el("sub", { text: `#${r.round}` })));
      }
      c.self.set(r.passes, r.tokens);
      c.twin.set(r.passes, r.tokens);
    });
  const s = done.stats;
  c.self.set(s.target_passes, s.new_tokens, charged(done));
  c.twin.set(s.target_passes, s.new_tokens, "one pass per token");
});

// ------------------------------------------------------------------ 2. all at once

bind("#step2 form", async (section) => {
  const out = $("#step2-out");
  out.replaceChildren();
  const shown = num("#step2-topk");
  const c = counters($(".counters", section), ["This step (one pass)", "Target-only twin (would need)"]);
  const r = await post("/predict", { text: $("#step2-text").value, top_k: Math.max(shown, 1) });
  let scored = 0;
  let same = 0;
  for (const t of r.tokens) {
    const li = el("li", { class: "position", tabindex: "0" });
    li.append(chip(t, "target"));
    const list = el("ol", { class: "topk", "aria-label": `predictions for ${show(t.text)}` });
    if (t.predicted.length) {
      scored++;
      if (t.predicted[0].id === t.id) same++;
      for (const p of t.predicted.slice(0, shown)) {
        const item = el("li", { class: p.id === t.id ? "hit" : "" });
        item.textContent = `${show(p.text)} ${pct(p.prob)}`;
        list.append(item);
      }
    } else {
      list.append(el("li", { class: "none", text: "(first)" }));
    }
    li.append(list);
    out.append(li);
  }
  const next = el("li", { class: "position next", tabindex: "0" });
  next.append(el("span", { class: "tok next-label", text: "next →" }));
  const list = el("ol", { class: "topk", "aria-label": "predictions after the text" });
  for (const p of r.next.slice(0, shown)) list.append(el("li", { text: `${show(p.text)} ${pct(p.prob)}` }));
  next.append(list);
  out.append(next);
  const predictions = scored + 1;
  $("#step2-summary").textContent =
    `${predictions} predictions from 1 pass; the target's top token matches the text at ${same} of ${scored} positions.`;
  c.self.set(r.passes, predictions, charged(r));
  c.twin.set(predictions, predictions, "one pass per position");
});

// ------------------------------------------------------------------ 3. you guess

bind("#step3 form", async (section) => {
  const out = $("#step3-out");
  out.replaceChildren();
  const eq = $("#step3-equality");
  eq.textContent = "";
  const prompt = $("#step3-prompt").value;
  const c = counters($(".counters", section));
  const r = await post("/check", { prompt, guess: $("#step3-guess").value });
  r.positions.forEach((p, i) => {
    const kind = i < r.accepted ? "accepted" : i === r.first_mismatch ? "rejected" : "unused";
    out.append(chip(p.guess, kind, ` · target ${pct(p.guess.prob)}`));
    if (i === r.first_mismatch) out.append(chip(p.predicted, "recovered", " · the target's token"));
  });
  if (r.first_mismatch < 0) out.append(chip(r.committed[r.committed.length - 1], "bonus"));
  const committed = r.committed.map((t) => t.id);
  c.self.set(r.passes, committed.length,
    `${r.accepted} of your ${r.positions.length} tokens accepted, + 1 of the target's; ${charged(r)}`);
  const twin = await generate({ prompt, proposer: "none", max_new_tokens: committed.length },
    (ev) => c.twin.set(ev.passes, ev.tokens));
  c.twin.set(twin.stats.target_passes, twin.stats.new_tokens, charged(twin));
  equality(eq, committed, twin.token_ids.slice(0, committed.length));
});

// ------------------------------------------------------------------ 4. copy and check

function roundRow(r) {
  const li = el("li", { class: "round" });
  li.append(el("span", { class: `source ${r.source || "none"}`, text: r.source || "target" }));
  const body = el("span", { class: "drafts" });
  r.drafted.forEach((t, i) => body.append(chip(t, i < r.accepted ? "accepted" : "rejected")));
  const extra = r.committed[r.accepted];
  if (extra) {
    const kind = r.drafted.length === 0 ? "target" : r.extra_kind;
    body.append(el("span", { class: "plus", text: "+" }), chip(extra, kind));
  }
  li.append(body);
  li.append(el("span", { class: "tally", text: `pass ${r.round} · ${r.tokens} tokens` }));
  return li;
}

bind("#step4 form", async (section) => {
  const out = $("#step4-out");
  out.replaceChildren();
  const eq = $("#step4-equality");
  eq.textContent = "";
  const prompt = $("#step4-prompt").value;
  const tokens = num("#step4-tokens");
  const c = counters($(".counters", section));
  const body = { prompt, proposer: $("#step4-proposer").value, k: num("#step4-k"),
                 max_new_tokens: tokens, guess: $("#step4-guess").value };
  const run = await generate(body, (r) => { out.append(roundRow(r)); c.self.set(r.passes, r.tokens); });
  const s = run.stats;
  c.self.set(s.target_passes, s.new_tokens,
    `${s.accepted_tokens} of ${s.drafted_tokens} drafted accepted; ${charged(run)}`);
  if (run.quota_stop) {
    status(section, run.quota_stop, "error quota-error");
    return;
  }
  const twin = await generate({ prompt, proposer: "none", max_new_tokens: tokens },
    (r) => c.twin.set(r.passes, r.tokens));
  c.twin.set(twin.stats.target_passes, twin.stats.new_tokens, charged(twin));
  if (twin.quota_stop) {
    status(section, twin.quota_stop, "error quota-error");
    return;
  }
  equality(eq, run.token_ids, twin.token_ids);
});

// ------------------------------------------------------------------ 5. the speed-up model

const sliders = ["alpha", "k", "c", "v"];
let measuredPoint = null; // {k, speedup} of the last measurement

function plot(svg, points, xKey, xMax, marker, ring) {
  const W = 320, H = 180, L = 34, B = 22, T = 8, R = 8;
  const yMax = Math.max(2, ...points.map((p) => p.speedup), ring ? ring.y : 0) * 1.05;
  const x = (v) => L + (v / xMax) * (W - L - R);
  const y = (v) => H - B - (v / yMax) * (H - B - T);
  const path = points.map((p, i) => `${i ? "L" : "M"}${x(p[xKey]).toFixed(1)},${y(p.speedup).toFixed(1)}`).join("");
  const ns = "http://www.w3.org/2000/svg";
  const node = (tag, attrs) => {
    const n = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    return n;
  };
  svg.replaceChildren();
  svg.append(node("line", { x1: L, y1: y(1), x2: W - R, y2: y(1), class: "one" }));
  svg.append(node("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }));
  svg.append(node("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" }));
  for (const v of [0, 1, Math.floor(yMax)]) {
    const t = node("text", { x: L - 4, y: y(v) + 4, class: "tick", "text-anchor": "end" });
    t.textContent = `${v}×`;
    svg.append(t);
  }
  for (const v of [0, xMax / 2, xMax]) {
    const t = node("text", { x: x(v), y: H - 6, class: "tick", "text-anchor": "middle" });
    t.textContent = String(v);
    svg.append(t);
  }
  svg.append(node("path", { d: path, class: "curve" }));
  if (marker) svg.append(node("circle", { cx: x(marker.x), cy: y(marker.y), r: 4, class: "marker" }));
  if (ring) svg.append(node("circle", { cx: x(ring.x), cy: y(ring.y), r: 6, class: "ring" }));
}

let chartRequest = 0;
async function redraw() {
  const values = Object.fromEntries(sliders.map((s) => [s, Number($(`#s-${s}`).value)]));
  for (const s of sliders) $(`#o-${s}`).textContent = s === "k" ? String(values[s]) : values[s].toFixed(2);
  const mine = ++chartRequest;
  const query = new URLSearchParams(Object.entries(values).map(([k, v]) => [k, String(v)]));
  const reply = await fetch(`${API}/speedup?${query}`);
  const m = await reply.json();
  if (mine !== chartRequest || !reply.ok) return;
  const be = m.break_even_alpha === null ? "never" : m.break_even_alpha.toFixed(2);
  const node = $("#step5-speedup");
  node.dataset.speedup = String(m.speedup);
  node.textContent = `Predicted speed-up ${m.speedup.toFixed(2)}× (${m.tokens_per_pass.toFixed(2)} tokens per pass); ` +
    `best k here ${m.best_k}; breaks even at α ≥ ${be}.`;
  const ring = measuredPoint && measuredPoint.k <= 16 ? { x: measuredPoint.k, y: measuredPoint.speedup } : null;
  plot($("#chart-k"), m.over_k, "k", 16, { x: m.k, y: m.speedup }, ring);
  plot($("#chart-alpha"), m.over_alpha, "alpha", 1, { x: m.alpha, y: m.speedup },
    measuredPoint && measuredPoint.k === m.k ? { x: measuredPoint.alpha, y: measuredPoint.speedup } : null);
}
for (const s of sliders) $(`#s-${s}`).addEventListener("input", redraw);

bind("#step5 form", async (section) => {
  const prompt = $("#step5-prompt").value;
  const tokens = num("#step5-tokens");
  const k = 4;
  const c = counters($(".counters", section));
  let accepted = 0, tested = 0; // alpha as the formula means it: accepted / drafted tokens tested
  const run = await generate({ prompt, proposer: "draft", k, max_new_tokens: tokens }, (r) => {
    c.self.set(r.passes, r.tokens);
    if (r.drafted.length) {
      accepted += r.accepted;
      tested += Math.min(r.drafted.length, r.accepted + 1); // drafts after a rejection were never tested
    }
  });
  c.self.set(run.stats.target_passes, run.stats.new_tokens, charged(run));
  const twin = await generate({ prompt, proposer: "none", max_new_tokens: tokens },
    (r) => c.twin.set(r.passes, r.tokens));
  c.twin.set(twin.stats.target_passes, twin.stats.new_tokens, charged(twin));
  const s = run.stats, t = twin.stats;
  if (run.quota_stop || twin.quota_stop) throw new ApiError(429, { error: { message: run.quota_stop || twin.quota_stop } });
  const pass1 = t.target_ms / Math.max(t.target_passes, 1); // a one-token target pass
  const alpha = tested ? accepted / tested : 0;
  const cost = s.drafted_tokens ? (s.draft_ms / s.drafted_tokens) / pass1 : 0;
  const v = (s.target_ms / Math.max(s.target_passes, 1)) / pass1;
  const measured = (t.total_ms / Math.max(t.new_tokens, 1)) / (s.total_ms / Math.max(s.new_tokens, 1));
  measuredPoint = { k, alpha, speedup: measured };
  const m = $("#step5-measured");
  Object.assign(m.dataset, { alpha, c: cost, v, measured });
  m.textContent = `Measured on this stack: α = ${alpha.toFixed(2)}, c = ${cost.toFixed(2)}, v = ${v.toFixed(2)}; ` +
    `wall-clock speed-up ${measured.toFixed(2)}× over target-only (${s.new_tokens} tokens; ` +
    `${s.target_passes} vs ${t.target_passes} target passes).`;
  $("#s-alpha").value = alpha.toFixed(2);
  $("#s-k").value = String(k);
  $("#s-c").value = Math.min(cost, 1).toFixed(2);
  $("#s-v").value = Math.min(Math.max(v, 0.5), 3).toFixed(2);
  await redraw();
});

// ------------------------------------------------------------------ 5. the sampling panel

bind("#sample-form", async (section) => {
  const table = $("#sample-out");
  table.replaceChildren();
  const sampler = $("input[name=sampler]:checked").value;
  const r = await post("/sample", { prompt: $("#sample-prompt").value, draws: num("#sample-draws"),
    temperature: num("#sample-temperature"), top_k: num("#sample-topk"), sampler, seed: 1 });
  table.append(el("caption", { text: `${r.draws} first tokens, ${r.sampler} sampler` }));
  const head = el("tr");
  for (const h of ["token", "p (target)", "frequency", ""]) head.append(el("th", { scope: "col", text: h }));
  table.append(el("thead", {}, head));
  const tbody = el("tbody");
  const top = Math.max(...r.bins.map((b) => Math.max(b.p, b.freq)));
  for (const b of r.bins) {
    const bars = el("td", { class: "bars" },
      el("span", { class: "bar p", style: `width:${(100 * b.p / top).toFixed(1)}%` }),
      el("span", { class: "bar f", style: `width:${(100 * b.freq / top).toFixed(1)}%` }));
    tbody.append(el("tr", {}, el("th", { scope: "row", text: b.other ? b.label : show(b.label) }),
      el("td", { text: pct(b.p) }), el("td", { text: pct(b.freq) }), bars));
  }
  table.append(tbody);
  const verdict = $("#sample-verdict");
  const ok = r.p_value >= 0.01;
  Object.assign(verdict.dataset, { pValue: r.p_value, sampler: r.sampler, consistent: ok });
  verdict.className = `verdict ${ok ? "equal" : "differ"}`;
  verdict.textContent = `χ² = ${r.chi_square.toFixed(1)} on ${r.dof} degrees of freedom, p-value ${r.p_value.toPrecision(3)}: ` +
    (ok ? "consistent with the target's p." : "the frequencies are NOT the target's p.");
  // The panel's own counters (the section's first ones belong to the speed-up run).
  const panel = counters($("#sample-counters"), ["This panel (one pass)", "Target-only twin (would need)"]);
  panel.self.set(r.passes, r.draws, `${charged(r)}; draws reuse one pass's p and q`);
  panel.twin.set(r.target_only_passes, r.draws, "one generation per draw");
});

// ------------------------------------------------------------------ start

// Shown only where the orchestrator requires a token; every call then carries it.
function askForToken(info) {
  if (info.credentials !== "required") return;
  const form = $("#credentials");
  const input = $("#token");
  form.hidden = false;
  input.value = sessionStorage.getItem(TOKEN_KEY) || "";
  input.addEventListener("change", () => sessionStorage.setItem(TOKEN_KEY, input.value.trim()));
  form.addEventListener("submit", (event) => event.preventDefault());
}

// Step 4's choices: the proposers the orchestrator serves (its registry), prompt lookup first.
function showProposers(proposers) {
  const select = $("#step4-proposer");
  select.replaceChildren();
  for (const p of proposers) {
    const option = document.createElement("option");
    option.value = p.name;
    option.textContent = `${p.name}: ${p.summary}`;
    option.selected = p.name === "lookup";
    select.append(option);
  }
}

(async () => {
  try {
    const reply = await fetch(`${API}/info`);
    const info = await reply.json();
    showQuota(info.quota);
    askForToken(info);
    showProposers(info.proposers || []);
  } catch (err) {
    $("#quota").textContent = `The gateway does not answer: ${err.message}`;
  }
  redraw();
})();
