"""The explorer page's own CSS and script (hand-written, no library; see labkit/pictures/explorer.py).

The script reads the inlined ``#walk-data`` JSON and draws one step at a time. Fields that older
evidence lacks (``after.pool``, ``inputs.block_tables``, ``inputs.max_seqlen_*``, ``inputs.input_ids``)
are shown as "not recorded in this evidence" rather than guessed.
"""

CSS = """
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #222; background: #fafafa; }
header { position: sticky; top: 0; background: #fff; border-bottom: 1px solid #ddd; padding: 8px 16px; z-index: 2; }
h1 { font-size: 17px; margin: 0 0 2px 0; }
h2 { font-size: 15px; margin: 0 0 6px 0; }
.sub { margin: 0 0 6px 0; color: #666; font-size: 12px; }
#controls { display: flex; align-items: center; gap: 10px; }
#slider { flex: 1; max-width: 520px; }
button { font: inherit; padding: 2px 10px; }
main { display: grid; grid-template-columns: repeat(auto-fit, minmax(460px, 1fr)); gap: 12px; padding: 12px 16px; }
section { background: #fff; border: 1px solid #e3e3e3; border-radius: 6px; padding: 10px 12px; overflow-x: auto; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border-bottom: 1px solid #eee; padding: 3px 8px; text-align: left; vertical-align: top; }
th { color: #555; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 5px; vertical-align: -1px; }
.note { color: #8a6d00; font-size: 12px; margin: 6px 0 0 0; }
.pool { display: grid; grid-template-columns: repeat(auto-fill, 46px); gap: 3px; }
.blk { height: 40px; border: 1px solid #ccc; border-radius: 3px; font-size: 11px; position: relative; text-align: center; color: #fff; }
.blk .id { position: absolute; top: 1px; left: 3px; font-size: 10px; opacity: 0.9; }
.blk .who { position: absolute; bottom: 2px; left: 0; right: 0; font-weight: 600; }
.blk .rc { position: absolute; top: 1px; right: 3px; background: #fff; color: #000; border-radius: 6px; padding: 0 3px; font-size: 10px; }
.blk.free { background: #fff; color: #999; }
.blk.cached { color: #333; }
.blk.shared { outline: 2px solid #000; }
section.wide { grid-column: 1 / -1; }
table.strip td { width: 34px; height: 22px; text-align: center; border: 1px solid #fff; font-size: 11px; cursor: pointer; padding: 0; }
table.strip th { font-size: 11px; cursor: pointer; text-align: center; }
table.strip td.now, table.strip th.now { outline: 2px solid #000; outline-offset: -2px; }
.legend span { margin-right: 12px; font-size: 12px; }
code, .mono { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12px; }
.ids { max-width: 100%; word-break: break-all; }
.built { color: #555; font-size: 12px; margin: 6px 0 0 0; }
"""

SCRIPT = r"""
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("walk-data").textContent);
  var steps = D.steps, views = D.views, cur = 0;
  var slider = document.getElementById("slider");

  function el(tag, attrs, children) {
    var e = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) {
      if (k === "text") e.textContent = attrs[k]; else if (k === "style") e.style.cssText = attrs[k]; else e.setAttribute(k, attrs[k]);
    });
    (children || []).forEach(function (c) { e.appendChild(typeof c === "string" ? document.createTextNode(c) : c); });
    return e;
  }
  function table(head, rows) {
    var t = el("table", {}, [el("tr", {}, head.map(function (h) { return el("th", {text: h}); }))]);
    rows.forEach(function (r) {
      t.appendChild(el("tr", {}, r.map(function (c) {
        if (c instanceof Node) return el("td", {}, [c]);
        return el("td", {text: c === null || c === undefined ? "–" : String(c), "class": typeof c === "number" ? "num" : ""});
      })));
    });
    return t;
  }
  function who(label) {
    return el("span", {}, [el("span", {"class": "swatch", style: "background:" + (D.colours[label] || "#999")}), label]);
  }
  function note(text) { return el("p", {"class": "note", text: text}); }
  function ranges(xs) {                 // [5,6,7,9] -> "5–7, 9"
    var out = [], i = 0;
    while (i < xs.length) {
      var j = i;
      while (j + 1 < xs.length && xs[j + 1] === xs[j] + 1) j++;
      out.push(j > i ? xs[i] + "–" + xs[j] : String(xs[i]));
      i = j + 1;
    }
    return out.join(", ");
  }
  function fill(id, nodes) {
    var box = document.getElementById(id);
    box.textContent = "";
    nodes.forEach(function (n) { box.appendChild(n); });
  }
  function phaseOf(st, s) {
    if (st.phase === "decode") return "decode";
    return s.cached + s.scheduled < s.total ? "prefill chunk" : "prefill";
  }

  function renderBatch(st) {
    var after = st.after || {}, byLabel = {};
    (after.seqs || []).forEach(function (s) { byLabel[s.label] = s; });
    var rows = (st.before || []).map(function (s) {
      var a = byLabel[s.label] || {};
      var fate = (after.finished || []).indexOf(s.label) >= 0 ? "finished" :
                 (after.discarded || []).indexOf(s.label) >= 0 ? "sample discarded (chunk)" : (a.status || "");
      return [who(s.label), phaseOf(st, s), s.scheduled, s.total + " / " + s.cached, a.total + " / " + a.cached, fate];
    });
    return [table(["request", "phase", "tokens scheduled", "before: total / cached", "after: total / cached", "after this step"], rows),
            el("p", {"class": "mono", text: "running after: [" + (after.running || []).join(", ") + "]   waiting after: [" +
               (after.waiting || []).join(", ") + "]   free blocks after: " + after.free_blocks})];
  }

  function renderPool(i) {
    var v = views[i], nodes = [], grid = el("div", {"class": "pool"});
    v.blocks.forEach(function (b) {
      var cls = "blk", style = "", label = "";
      if (b.owners.length === 0 && b.hashed) { cls += " cached"; style = "background:" + D.cached_colour; label = "cached"; }
      else if (b.owners.length === 0) { cls += " free"; }
      else {
        var cs = b.owners.map(function (o) { return D.colours[o] || "#999"; }), stops = [];
        cs.forEach(function (c, k) { stops.push(c + " " + (100 * k / cs.length) + "%", c + " " + (100 * (k + 1) / cs.length) + "%"); });
        style = "background:linear-gradient(" + stops.join(",") + ")";
        label = b.owners.join("+") + (b.hashed ? " #" : "");
        if (b.ref_count > 1) cls += " shared";
      }
      var kids = [el("span", {"class": "id", text: String(b.id)}), el("span", {"class": "who", text: label})];
      if (b.ref_count > 1) kids.push(el("span", {"class": "rc", text: "×" + b.ref_count}));
      grid.appendChild(el("div", {"class": cls, style: style, title: "block " + b.id + ": ref_count " + b.ref_count +
        (b.hashed ? ", hashed" : ", no hash") + (b.owners.length ? ", owners " + b.owners.join(", ") : ", free")}, kids));
    });
    nodes.push(grid);
    nodes.push(el("p", {"class": "note", style: "color:#555",
      text: "block id top left; owner(s) at the bottom (# = hashed, full block); ×N = ref count (shared); " +
            "'cached' = free, hash kept; white = free" + (D.block_size ? "; a block holds " + D.block_size + " tokens" : "")}));
    var gone = v.preempted || {}, byLab = {};
    Object.keys(gone).forEach(function (b) { (byLab[gone[b]] = byLab[gone[b]] || []).push(b); });
    Object.keys(byLab).forEach(function (lab) {
      nodes.push(el("p", {"class": "note preempted", text: "preempted in this step: " + lab + " (blocks " + byLab[lab].join(", ") +
        " given back by Scheduler.preempt before the forward; it waits again, cached = 0)"}));
    });
    D.pool_notes.forEach(function (n) { nodes.push(note(n)); });
    return nodes;
  }

  function renderTables(st) {
    var inp = st.inputs || {}, nodes = [];
    if (inp.block_tables) {
      nodes.push(table(["row", "request", "block_tables (padded with -1, as the model received it)"],
        inp.block_tables.map(function (r, k) { return [k, st.before[k] ? who(st.before[k].label) : "?", "[" + r.join(", ") + "]"]; })));
    } else {
      nodes.push(table(["request", "block table (as scheduled)"],
        (st.before || []).map(function (s) { return [who(s.label), "[" + s.block_table.join(", ") + "]"]; })));
      nodes.push(note(inp.has_block_tables === false ?
        "the model got no block_tables in this step (a prefill without cached prefix reads K/V from the step itself)" :
        "inputs.block_tables not recorded in this evidence: the tables as scheduled are shown"));
    }
    return nodes;
  }

  function renderSlots(i, st) {
    var v = views[i], inp = st.inputs || {}, bs = D.block_size;
    if (!inp.slot_mapping) return [note("no slot_mapping recorded in this step")];
    var rows = v.spans.map(function (s) {
      function span(a) { return s.length === 1 ? String(a) : a + "–" + (a + s.length - 1); }
      return [who(s.label), span(s.batch_start), span(s.position), span(s.first_slot), s.block_id, s.length];
    });
    return [table(["request", "batch index", "positions", "slots", "block", "tokens"], rows),
            el("p", {"class": "note", style: "color:#555", text: "slot = block_table[pos // " + bs + "] × " + bs + " + pos % " + bs +
               "; one row per run of tokens that lands in one block"})];
  }

  function renderShapes(st) {
    var inp = st.inputs || {}, nodes = [];
    function shown(k) { return inp[k] === undefined ? "not recorded in this evidence" : JSON.stringify(inp[k]); }
    var rows = [["input_shape", shown("input_shape")], ["cu_seqlens_q", shown("cu_seqlens_q")], ["cu_seqlens_k", shown("cu_seqlens_k")],
                ["max_seqlen_q", shown("max_seqlen_q")], ["max_seqlen_k", shown("max_seqlen_k")],
                ["context_lens", shown("context_lens")], ["has_block_tables", shown("has_block_tables")],
                ["positions", inp.positions ? ranges(inp.positions) : "–"]];
    nodes.push(table(["field", "value"], rows));
    if (inp.input_ids) {
      var ids = inp.input_ids.length > 64 ? inp.input_ids.slice(0, 64).join(", ") + ", … (" + inp.input_ids.length + " ids)" : inp.input_ids.join(", ");
      nodes.push(el("p", {"class": "mono ids", text: "input_ids: [" + ids + "]"}));
    } else {
      nodes.push(note("input_ids not recorded in this evidence"));
    }
    return nodes;
  }

  function builtBy(section) {        // the engine functions that make what a section shows, with file:line
    var fs = (D.built_by || {})[section] || [];
    if (!fs.length) return [];
    var p = el("p", {"class": "built"}, ["built by "]);
    fs.forEach(function (f, k) {
      if (k) p.appendChild(document.createTextNode(", "));
      p.appendChild(el("a", {href: f.href, title: f.file + ":" + (f.line || "?")}, [f.name]));
      p.appendChild(el("span", {"class": "mono", text: " (" + f.file + ":" + (f.line || "?") + ")"}));
    });
    return [p];
  }

  function renderAttention(st) {
    var A = D.attention || {calls: {}}, r = st.route, nodes = [];
    if (!st.attention) return [note("no per-sequence attention branch recorded in this evidence")];
    nodes.push(el("p", {"class": "mono", text: "route: " + (r ? r.route + (r.fused ? " (fused kernels)" : " (plain path: store_kv writes K/V)") :
      "not recorded in this evidence")}));
    var perStep = A.per_step && st.phase === "prefill" && (st.inputs || {}).has_block_tables;
    nodes.push(table(["request", "branch", "queries / keys", "call (" + A.backend + " backend)"],
      st.attention.map(function (a) {
        var br = perStep ? "prefill-cached" : a.branch;
        return [who(a.label), br, a.queries + " / " + a.keys, A.calls[br] || "?"];
      })));
    if (perStep) nodes.push(note(A.backend + ": a prefill step with block_tables reads every sequence through the pages"));
    return nodes;
  }

  function renderStrip() {            // the steps x requests grid of the pictures, one column per step
    var G = D.grid, t = el("table", {"class": "strip"}), head = el("tr", {}, [el("th", {text: "step"})]);
    steps.forEach(function (st, j) { head.appendChild(el("th", {text: String(st.step), "data-col": String(j)})); });
    t.appendChild(head);
    G.labels.forEach(function (lab, i) {
      var tr = el("tr", {}, [el("th", {}, [who(lab)])]);
      steps.forEach(function (st, j) {
        var kind = G.kinds[i][j], tok = G.tokens[i][j];
        var text = (tok === null ? "" : String(tok)) + (G.finished[i][j] ? " ✓" : "");
        var dark = kind === "prefill" || kind === "decode" || kind === "preempted";
        tr.appendChild(el("td", {text: text, "data-col": String(j), title: lab + ", step " + st.step + ": " + (kind || "not submitted yet"),
          style: "background:" + (kind ? D.kind_colours[kind] : "#fff") + (dark ? ";color:#fff" : "")}));
      });
      t.appendChild(tr);
    });
    t.addEventListener("click", function (e) {
      var c = e.target.closest("[data-col]");
      if (c) show(parseInt(c.getAttribute("data-col"), 10));
    });
    var legend = el("p", {"class": "legend"});
    Object.keys(D.kind_colours).forEach(function (k) {
      legend.appendChild(el("span", {}, [el("span", {"class": "swatch", style: "background:" + D.kind_colours[k] + ";border:1px solid #ccc"}), k]));
    });
    fill("strip", [t, legend]);
  }
  function markStrip() {
    document.querySelectorAll("#strip [data-col]").forEach(function (c) {
      c.classList.toggle("now", c.getAttribute("data-col") === String(cur));
    });
  }

  function show(i) {
    cur = Math.max(0, Math.min(steps.length - 1, i));
    var st = steps[cur];
    slider.value = String(cur);
    document.getElementById("shown-step").textContent = String(st.step);
    document.getElementById("shown-phase").textContent = st.phase;
    document.body.setAttribute("data-step", String(st.step));
    fill("batch", renderBatch(st).concat(builtBy("batch")));
    fill("pool", renderPool(cur).concat(builtBy("pool")));
    fill("tables", renderTables(st).concat(builtBy("tables")));
    fill("slots", renderSlots(cur, st).concat(builtBy("slots")));
    fill("shapes", renderShapes(st).concat(builtBy("shapes")));
    fill("attention", renderAttention(st).concat(builtBy("attention")));
    markStrip();
    var want = "#step=" + st.step;
    if (location.hash !== want) history.replaceState(null, "", want);
  }
  function fromHash() {
    var m = /step=(\d+)/.exec(location.hash || "");
    if (!m) return 0;
    var n = parseInt(m[1], 10);
    for (var k = 0; k < steps.length; k++) if (steps[k].step === n) return k;
    return 0;
  }

  slider.addEventListener("input", function () { show(parseInt(slider.value, 10)); });
  document.getElementById("prev").addEventListener("click", function () { show(cur - 1); });
  document.getElementById("next").addEventListener("click", function () { show(cur + 1); });
  document.addEventListener("keydown", function (e) {
    if (e.target === slider) return;      // the slider moves itself (its input event shows the step)
    if (e.key === "ArrowLeft") { show(cur - 1); e.preventDefault(); }
    if (e.key === "ArrowRight") { show(cur + 1); e.preventDefault(); }
  });
  window.addEventListener("hashchange", function () { show(fromHash()); });
  renderStrip();
  show(fromHash());
})();
"""
