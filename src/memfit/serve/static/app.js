// memfit serve: builds the form from /api/options (memfit's own option list), posts its values to /api/plan as
// they change (debounced), and shows the answer. Text from the server is set as text, never parsed as HTML.
"use strict";

(() => {
  const DEBOUNCE_MS = 250;
  const CHART_ID = "memfit-breakdown";
  const PLOT_CONFIG = {displaylogo: false, responsive: true};
  const state = {fields: [], seq: 0, timer: null, controller: null};
  const $ = (id) => document.getElementById(id);

  // A field's suggested values as a datalist under its input (the setup form's and the RL form's).
  function suggest(row, input, field, id) {
    if (!field.suggestions) return;
    const list = el("datalist", {id: id + "-list"},
                    ...field.suggestions.map((s) => el("option", {value: s.value, label: s.label})));
    input.setAttribute("list", list.id);
    row.append(list);
  }

  function el(tag, props = {}, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props)) {
      if (key === "text") node.textContent = value;
      else if (key === "className") node.className = value;
      else node.setAttribute(key, value);
    }
    node.append(...children);
    return node;
  }

  function fieldRow(field, value) {
    const id = "f-" + field.name;
    let input;
    if (field.kind === "choice") {
      const fallback = field.default ? `default (${field.default})` : "default";
      input = el("select", {id, name: field.name}, el("option", {value: "", text: fallback}),
                 ...field.choices.map((choice) => el("option", {value: choice, text: choice})));
      if (field.choices.includes(value)) input.value = value;
    } else if (field.kind === "flag") {
      input = el("input", {id, name: field.name, type: "checkbox"});
      input.checked = ["1", "true", "on", "yes"].includes(String(value).toLowerCase());
    } else {
      input = el("input", {id, name: field.name, type: "text", spellcheck: "false"});
      if (field.numeric) input.setAttribute("inputmode", "decimal");
      input.placeholder = field.default ? `default: ${field.default}` : "";
      input.value = value;
    }
    const row = el("div", {className: "field"}, el("label", {for: id, text: field.label}), input);
    suggest(row, input, field, id);
    if (field.help) input.title = field.help;
    const changed = () => schedule();
    input.addEventListener("input", changed);
    input.addEventListener("change", changed);
    return row;
  }

  // The first section (model, GPU, method, GPUs, micro-batch, sequence) is always shown; the others are folded
  // (<details>), and open by themselves when the address sets one of their fields or the server marks one.
  function buildForm(options) {
    const params = new URLSearchParams(window.location.search);
    const holder = $("fields");
    holder.replaceChildren();
    state.fields = options.fields;
    const initial = (f) => params.get(f.name) ?? options.initial[f.name] ?? "";
    for (const section of options.sections) {
      const fields = options.fields.filter((f) => f.section === section.name);
      if (!fields.length) continue;
      const rows = fields.map((f) => fieldRow(f, initial(f)));
      if (section.open) {
        holder.append(el("fieldset", {className: "main"}, el("legend", {text: section.name}), ...rows));
        continue;
      }
      const folded = el("details", {className: "section"},
                        el("summary", {text: `${section.name} (${fields.length})`}), ...rows);
      folded.open = fields.some((f) => params.get(f.name));
      holder.append(folded);
    }
  }

  function values() {
    const out = {};
    for (const field of state.fields) {
      const input = $("f-" + field.name);
      if (field.kind === "flag") {
        if (input.checked) out[field.name] = "true";
      } else if (input.value.trim() !== "") {
        out[field.name] = input.value;
      }
    }
    return out;
  }

  function schedule(delay = DEBOUNCE_MS) {
    clearTimeout(state.timer);
    state.timer = setTimeout(update, delay);
  }

  function finish(outcome) {
    document.body.dataset.state = outcome;
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  }

  async function update() {
    const seq = ++state.seq;
    if (state.controller) state.controller.abort();
    const controller = new AbortController();
    state.controller = controller;
    document.body.dataset.state = "loading";
    const given = values();
    window.history.replaceState(null, "", "?" + new URLSearchParams(given).toString());
    let reply, data;
    try {
      reply = await fetch("/api/plan", {method: "POST", headers: {"Content-Type": "application/json"},
                                        body: JSON.stringify(given), signal: controller.signal});
      data = await reply.json().catch(() => ({}));
    } catch (error) {
      if (error.name === "AbortError") return;
      if (seq !== state.seq) return;
      showError("the memfit page server did not answer: " + error.message, null);
      finish("error");
      return;
    }
    if (seq !== state.seq) return;
    if (!reply.ok) {
      showError(data.error || `the server answered ${reply.status}`, data.field);
      finish("error");
      return;
    }
    clearError();
    show(data);
    finish("ready");
  }

  function clearError() {
    const box = $("form-error");
    box.hidden = true;
    box.textContent = "";
    for (const node of document.querySelectorAll("[aria-invalid]")) {
      node.removeAttribute("aria-invalid");
      node.removeAttribute("aria-describedby");
    }
    $("result").classList.remove("stale");
    $("stale").hidden = true;
  }

  function showError(message, field) {
    clearError();
    const box = $("form-error");
    box.textContent = message;
    box.hidden = false;
    const input = field ? $("f-" + field) : null;
    if (input) {  // the message is at the top of the form; the input it is about is marked, and shown
      const folded = input.closest("details");
      if (folded) folded.open = true;
      input.setAttribute("aria-invalid", "true");
      input.setAttribute("aria-describedby", "form-error");
    }
    if (document.getElementById(CHART_ID).data) {  // a chart is up: keep it, marked as the last valid one
      $("result").classList.add("stale");
      $("stale").hidden = false;
    }
  }

  function fill(listId, items) {
    $(listId).replaceChildren(...items.map((text) => el("li", {text})));
  }

  function show(data) {
    const view = data.view;
    const verdict = $("verdict");
    verdict.textContent = `${view.title}: ${view.verdict}`;
    verdict.className = "verdict " + (view.fits ? "fits" : "nofit");
    $("initial").textContent = view.initial;
    $("final-setup").textContent = view.final_setup;
    $("final-setup-line").hidden = !view.final_setup;

    const figure = data.figure;
    window.Plotly.react(CHART_ID, figure.data, figure.layout, PLOT_CONFIG);

    $("ladder").tBodies[0].replaceChildren(...view.rungs.map((rung) => {
      const technique = el("td", {text: rung.title});
      if (rung.change) technique.append(el("div", {className: "detail"}, el("code", {text: rung.change})));
      if (rung.why) technique.append(el("div", {className: "detail", text: rung.why}));
      return el("tr", {}, el("td", {className: "num", text: rung.number}), technique,
                el("td", {className: "num", text: rung.gib}),
                el("td", {className: rung.fits ? "yes" : "no", text: rung.fits ? "yes" : `no: ${rung.bottleneck}`}),
                el("td", {text: rung.cost}));
    }));
    fill("skipped", view.skipped);
    $("skipped-block").hidden = !view.skipped.length;
    fill("suggestions", view.suggestions);
    $("suggestions-block").hidden = !view.suggestions.length;
    const snippets = Object.entries(view.snippets);
    $("snippets").replaceChildren(...snippets.flatMap(([label, text]) =>
      [el("p", {className: "note", text: label}), el("pre", {}, el("code", {text}))]));
    $("snippets-block").hidden = !snippets.length;
    $("command").textContent = data.command;
    fill("setup-notes", view.setup_notes);
    fill("notes", view.notes);
    $("json").textContent = JSON.stringify(data.plan, null, 2);
  }

  async function start() {
    try {
      const reply = await fetch("/api/options");
      if (!reply.ok) throw new Error(`the server answered ${reply.status}`);
      const options = await reply.json();
      buildForm(options);
      buildRlForm(options.rl);
    } catch (error) {
      showError("cannot load the form's options: " + error.message, null);
      finish("error");
      return;
    }
    schedule(0);
  }

  // RL phase bars: the RL section's fields (memfit rl's own options, from /api/options) and the free-text line
  // become `memfit rl`'s arguments, posted to /api/rl on submit and whenever a field changes
  const rl = {fields: []};

  function rlFieldRow(field) {
    const id = "rl-f-" + field.name;
    let input;
    if (field.kind === "choice" || field.kind === "switch") {
      const fallback = field.default ? `default (${field.default})` : "default";
      input = el("select", {id, name: field.name}, el("option", {value: "", text: fallback}),
                 ...field.choices.map((choice) => el("option", {value: choice, text: choice})));
    } else {
      input = el("input", {id, name: field.name, type: "text", spellcheck: "false"});
      input.placeholder = field.default ? `default: ${field.default}` : "";
    }
    input.value = field.initial;
    if (field.help) input.title = field.help;
    const row = el("div", {className: "field"}, el("label", {for: id, text: field.label}), input);
    suggest(row, input, field, id);
    input.addEventListener("change", () => sizeRl());
    return row;
  }

  function buildRlForm(fields) {
    rl.fields = fields || [];
    $("rl-fields").replaceChildren(...rl.fields.map(rlFieldRow));
  }

  function rlArgs() {
    const args = [];
    for (const field of rl.fields) {
      const value = $("rl-f-" + field.name).value.trim();
      if (!value) continue;
      if (field.flag === null) args.unshift(value);
      else if (field.kind === "switch") args.push(value);
      else args.push(field.flag, value);
    }
    return args.concat($("rl-args").value.trim().split(/\s+/).filter((word) => word));
  }

  async function sizeRl(event) {
    if (event) event.preventDefault();
    const args = rlArgs();
    $("rl-error").hidden = true;
    try {
      const reply = await fetch("/api/rl", {method: "POST", headers: {"Content-Type": "application/json"},
                                            body: JSON.stringify({args})});
      const data = await reply.json();
      if (!reply.ok) {
        $("rl-error").textContent = data.error;
        $("rl-error").hidden = false;
        return;
      }
      const est = data.estimate;
      $("rl-command").textContent = data.command;
      const gib = (bytes) => (bytes / 2 ** 30).toFixed(2);
      $("rl-verdict").textContent = `peak: ${est.peak_phase} ${gib(est.peak_bytes)} GiB of ` +
        `${gib(est.gpu_memory_bytes)} GiB: ${est.fits ? "fits" : "does not fit"}` +
        (est.vllm && est.vllm.recommended ? `; vllm_gpu_memory_utilization ${est.vllm.recommended.toFixed(2)}` : "");
      if (window.Plotly) window.Plotly.react("rl-phases", data.figure.data, data.figure.layout, PLOT_CONFIG);
    } catch (error) {
      $("rl-error").textContent = "cannot size it: " + error.message;
      $("rl-error").hidden = false;
    } finally {
      document.body.dataset.rlUpdates = String(Number(document.body.dataset.rlUpdates || 0) + 1);
    }
  }

  $("rl-form").addEventListener("submit", sizeRl);
  start();
})();
