// llmgw console: one dependency-free page over the console API (same origin, /api/...).
// Everything the API says (node names, reasons, engine output) is untrusted text: the
// DOM is built with createElement/textContent only, never from HTML strings.
'use strict';

// --- state: the session, the live stream, the view shown ------------------------------

// role and csrf from /api/session or /api/login; seq: the last change event's; gen: bumped
// on each route change and sign-out, so a late answer for an earlier view is dropped
const S = { role: '', csrf: '', seq: 0, es: null, view: null, gen: 0, fetchError: false };

// --- DOM helpers --------------------------------------------------------------------

const $ = (sel) => document.querySelector(sel);
const SVG_NS = 'http://www.w3.org/2000/svg';

// h('td', {class: 'x', data: {node: id}, title: '...'}, 'text', childNode, [more], ...)
function h(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  setAttrs(e, attrs);
  addKids(e, kids);
  return e;
}

function svg(tag, attrs) {
  const e = document.createElementNS(SVG_NS, tag);
  setAttrs(e, attrs);
  return e;
}

function setAttrs(e, attrs) {
  if (!attrs) return;
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === 'class') e.setAttribute('class', v);
    else if (k === 'data') Object.assign(e.dataset, v);
    else e.setAttribute(k, v === true ? '' : String(v));
  }
}

function addKids(e, kids) {
  for (const k of kids) {
    if (k === null || k === undefined || k === false) continue;
    if (Array.isArray(k)) addKids(e, k);
    else e.append(k instanceof Node ? k : String(k)); // a string becomes a text node
  }
}

// replace el's children with kids (strings, nodes, arrays; null and false skipped)
function fill(el, ...kids) {
  el.replaceChildren();
  addKids(el, kids);
}

function thead(...names) {
  return h('thead', null, h('tr', null, names.filter(Boolean).map((n) => h('th', { scope: 'col' }, n))));
}

// a class name from a server word ("Ready" -> "state-Ready"), letters only
const stateClass = (word) => 'state state-' + String(word).replace(/[^A-Za-z-]/g, '');

// --- formatting ---------------------------------------------------------------------

const DASH = '–';

function human(n) {
  if (n === null || n === undefined) return DASH;
  if (n < 1024) return `${n} B`;
  const exp = Math.min(Math.floor(Math.log(n) / Math.log(1024)), 4);
  return `${(n / 1024 ** exp).toFixed(1)} ${'KMGT'[exp - 1]}iB`;
}

function gib(bytes) {
  if (bytes === null || bytes === undefined) return DASH;
  const g = bytes / 2 ** 30;
  return g >= 100 ? String(Math.round(g)) : g.toFixed(1).replace(/\.0$/, '');
}

const pct = (x) => (x === null || x === undefined ? DASH : `${Math.round(x * 100)} %`);
const NUMBER_FORMATS = [0, 1, 2].map((d) => new Intl.NumberFormat('en-US', { maximumFractionDigits: d }));
const num = (x, digits = 0) => (x === null || x === undefined ? DASH : NUMBER_FORMATS[digits].format(x));

// "0.1.0 (build 1a2b3c4d5e6f)" as "0.1.0+1a2b3c4d5e6f", to fit a column (as ctl does)
function shortVersion(v) {
  if (!v) return DASH;
  const [number, build] = v.split(' (build ');
  return build ? `${number}+${build.replace(/\)$/, '')}` : number;
}

function ago(s) {
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${(s / 3600).toFixed(1).replace(/\.0$/, '')} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}

// "43 % of 2.1 GiB, 120.0 MiB/s from n1, 40 s left", as llmgw.weights.progress says it
function progressWords(p) {
  if (!p || !p.total_bytes) return '';
  const words = `${Math.round((100 * p.done_bytes) / p.total_bytes)} % of ${human(p.total_bytes)}`;
  const source = p.peer ? ` from ${p.peer}` : '';
  if (p.rate_bps > 0) {
    const left = (p.total_bytes - p.done_bytes) / p.rate_bps;
    return `${words}, ${human(Math.round(p.rate_bps))}/s${source}, ${Math.round(left)} s left`;
  }
  return words + source;
}

// --- messages (#message: one line, replaced each time) --------------------------------

function say(lines, kind = 'ok') {
  const m = $('#message');
  const list = Array.isArray(lines) ? lines : [lines];
  m.replaceChildren(...list.map((l) => h('div', null, l)));
  m.className = kind === 'ok' ? 'ok' : 'error';
  S.fetchError = kind === 'fetch';
}

function clearMessage() {
  $('#message').replaceChildren();
  $('#message').className = '';
  S.fetchError = false;
}

// --- API calls: never throw; {ok, status, data | error} ---------------------------------

async function api(path, { method = 'GET', body, csrf = true } = {}) {
  const opts = { method, headers: { Accept: 'application/json' }, credentials: 'same-origin' };
  if (method !== 'GET') {
    opts.headers['Content-Type'] = 'application/json';
    if (csrf) opts.headers['X-CSRF-Token'] = S.csrf;
    opts.body = JSON.stringify(body || {});
  }
  let resp;
  let data = null;
  try {
    resp = await fetch(path, opts);
    try {
      data = await resp.json();
    } catch (_) {
      data = null; // not JSON (a proxy's page, an empty body)
    }
  } catch (e) {
    return { ok: false, status: 0, error: `cannot reach the server: ${e.message}` };
  }
  if (resp.ok) return { ok: true, status: resp.status, data: data || {} };
  const msg = (data && data.error && data.error.message) || `${resp.status} ${resp.statusText}`.trim();
  return { ok: false, status: resp.status, error: msg };
}

// a failure: a 401 goes back to the sign-in form; anything else is said in #message
function failed(r, kind = 'fetch') {
  if (r.status === 401) signedOut();
  else say(r.error, kind);
}

// a view's GET: its data, or null (the failure already said)
async function get(path) {
  const r = await api(path);
  if (r.ok) return r.data;
  failed(r);
  return null;
}

// --- session: sign in, sign out ------------------------------------------------------

function signedIn(session, toFleet) {
  S.role = session.role === 'admin' ? 'admin' : 'viewer';
  S.csrf = session.csrf || '';
  document.body.dataset.role = S.role;
  document.body.classList.remove('signed-out');
  $('#role').textContent = S.role;
  $('#version').textContent = session.server_version ? `server ${session.server_version}` : '';
  $('#signin').hidden = true;
  $('#signin-error').textContent = '';
  startLive();
  if (toFleet && location.hash !== '#/fleet') location.hash = '#/fleet'; // hashchange routes
  else route();
}

function signedOut() {
  stopLive();
  const was = S.role;
  S.role = '';
  S.csrf = '';
  S.view = null;
  S.gen++;
  delete document.body.dataset.role;
  delete document.body.dataset.rendered;
  document.body.classList.add('signed-out');
  $('#view').replaceChildren();
  clearMessage();
  $('#signin').hidden = false;
  if (was || document.activeElement === document.body) $('#token').focus();
}

async function signIn(ev) {
  ev.preventDefault();
  const button = $('#signin-button');
  button.disabled = true;
  const r = await api('/api/login', { method: 'POST', body: { token: $('#token').value }, csrf: false });
  button.disabled = false;
  if (!r.ok) {
    $('#signin-error').textContent = r.error;
    return;
  }
  $('#token').value = '';
  signedIn(r.data, true);
}

async function signOut() {
  const r = await api('/api/logout', { method: 'POST' });
  if (r.ok || r.status === 401) signedOut();
  else failed(r, 'error');
}

// --- live: one EventSource; a change re-fetches what the view shown needs ------------------

const EVERYTHING = ['nodes', 'replicas', 'routing', 'traffic', 'intent'];

function setLive(on) {
  const live = $('#live');
  live.textContent = on ? 'live' : 'reconnecting';
  live.className = on ? 'session-only live-on' : 'session-only live-off';
}

function startLive() {
  stopLive();
  if (document.hidden) {
    $('#live').textContent = 'paused';
    return;
  }
  const es = new EventSource('/api/events');
  S.es = es;
  let opened = false;
  es.onopen = () => {
    setLive(true);
    if (opened && S.view) refresh(S.view, EVERYTHING); // changes missed while away
    opened = true;
  };
  es.onerror = () => {
    setLive(false);
    // CLOSED: the browser gave up (a 401, a non-stream answer): ask whether still signed in
    if (es.readyState === EventSource.CLOSED && S.es === es) {
      S.es = null;
      setTimeout(recheckSession, 3000);
    }
  };
  es.addEventListener('change', (ev) => {
    let d;
    try {
      d = JSON.parse(ev.data);
    } catch (_) {
      return;
    }
    onChange(Number(d.seq) || 0, Array.isArray(d.what) ? d.what : EVERYTHING);
  });
}

function pause() {
  if (!S.es) return;
  stopLive();
  $('#live').textContent = 'paused';
}

function resume() {
  if (!S.role || S.es || document.hidden) return;
  startLive();
  if (S.view) refresh(S.view, EVERYTHING); // what changed while it was away
}

function stopLive() {
  if (S.es) S.es.close();
  S.es = null;
  setLive(false);
}

async function recheckSession() {
  if (!S.role || S.es) return;
  const r = await api('/api/session');
  if (r.ok && r.data.role) startLive();
  else if (r.ok || r.status === 401) signedOut();
  else setTimeout(recheckSession, 10000); // the server is away: the stream comes back later
}

function onChange(seq, what) {
  S.seq = seq;
  const v = S.view;
  if (!v) return;
  if (v.wants(what)) refresh(v, what);
  else if (v.name === 'fleet' && (v.busy || v.what)) refresh(v, what); // to reach this seq
  else if (v.name === 'fleet' && document.body.dataset.rendered)
    document.body.dataset.rendered = String(seq); // nothing the fleet shows changed
}

// Coalesce: while a view's fetch is in flight, changes gather into one more fetch after it.
function refresh(view, what) {
  if (!view.what) view.what = new Set();
  for (const w of what) view.what.add(w);
  if (!view.busy) pump(view);
}

async function pump(view) {
  view.busy = true;
  const gen = S.gen;
  const current = () => S.gen === gen && S.view === view;
  while (view.what && current()) {
    const ctx = { what: view.what, seq: S.seq, current };
    view.what = null;
    try {
      if ((await view.load(ctx)) && S.fetchError) clearMessage(); // the server is back
    } catch (e) {
      say(`the page failed to show this: ${e.message}`, 'fetch');
    }
  }
  view.busy = false;
}

// --- routes: #/fleet, #/model/NAME, #/traffic ---------------------------------------------

function route() {
  if (!S.role) return;
  const hash = location.hash;
  let view;
  const m = /^#\/model\/(.+)$/.exec(hash);
  if (hash === '#/traffic') view = trafficView();
  else if (m) {
    let name = m[1];
    try {
      name = decodeURIComponent(name);
    } catch (_) {
      /* a malformed escape: the name as written */
    }
    view = modelView(name);
  } else {
    if (hash !== '#/fleet') history.replaceState(null, '', '#/fleet');
    view = fleetView();
  }
  S.gen++;
  S.view = view;
  delete document.body.dataset.rendered;
  document.body.dataset.view = view.name;
  for (const a of document.querySelectorAll('#top nav a'))
    a.classList.toggle('active', a.getAttribute('href') === `#/${view.name}`);
  $('#view').replaceChildren(view.root);
  window.scrollTo(0, 0);
  refresh(view, [...EVERYTHING, 'first']);
}

const admin = () => S.role === 'admin';

// --- fleet: counts, nodes, models --------------------------------------------------------

function fleetView() {
  const counts = h('div', { id: 'counts', class: 'counts' });
  const nodesBody = h('tbody');
  const modelsBody = h('tbody');
  const nodeCols = ['node', 'state', 'intent', 'fabric', 'GPUs', 'memory GiB',
    'version', 'shards', 'problems'];
  const root = h('div', { class: 'fleet' },
    h('div', { class: 'view-head' }, h('h1', null, 'Fleet'),
      admin() ? h('button', { id: 'reload', type: 'button' }, 'reload catalog') : null),
    counts,
    h('h2', null, 'Nodes'),
    h('table', { id: 'nodes', class: 'grid' }, thead(...nodeCols, admin() ? 'actions' : null), nodesBody),
    h('h2', null, 'Models'),
    h('table', { id: 'models', class: 'grid' },
      thead('model', 'wanted', 'ready', 'starting', 'failed', 'sleeping', 'problems'), modelsBody));
  root.addEventListener('click', onFleetClick);
  return {
    name: 'fleet',
    root,
    wants: (what) => what.some((w) => w !== 'traffic'),
    async load(ctx) {
      const [n, m] = await Promise.all([get('/api/nodes'), get('/api/models')]);
      if (!n || !m || !ctx.current()) return false;
      const nodes = n.nodes || [];
      const models = m.models || [];
      if (n.server_version) $('#version').textContent = `server ${n.server_version}`;
      const draining = new Set(nodes.filter((x) => x.draining && !x.drained).map((x) => x.node_id));
      renderCounts(counts, nodes, models, draining);
      const nf = document.createDocumentFragment();
      for (const node of nodes) nf.append(nodeRow(node));
      nodesBody.replaceChildren(nf);
      const mf = document.createDocumentFragment();
      for (const model of models) mf.append(modelRow(model, draining));
      modelsBody.replaceChildren(mf);
      document.body.dataset.rendered = String(ctx.seq);
      return true;
    },
  };
}

function intentWords(n) {
  if (n.drained) return 'drained';
  if (n.draining) return `draining (${n.shards} shards left)`;
  if (n.cordoned) return 'cordoned';
  return '';
}

function nodeProblems(n) {
  const words = [...(n.problems || [])];
  if (n.awaited) words.push('known from before the server restarted, not back since');
  return words;
}

function gpuCell(n) {
  const gpus = n.gpus || [];
  if (!gpus.length) return h('td', { class: 'gpus' }, 'none');
  const groups = new Map(); // "name|MiB" -> count
  for (const g of gpus) {
    const key = `${g.name}|${g.memory_total_mib ?? ''}`;
    groups.set(key, (groups.get(key) || 0) + 1);
  }
  const kinds = [...groups].map(([key, count]) => {
    const [name, mib] = key.split('|');
    return `${count}× ${name.replace(/^NVIDIA /, '')}${mib ? ` (${gib(Number(mib) * 2 ** 20)} GiB)` : ''}`;
  });
  const bad = gpus.filter((g) => !g.healthy).map((g) =>
    h('div', { class: 'bad', data: { gpu: g.index } },
      `GPU ${g.index} unhealthy: ${(g.problems || []).join(', ') || 'no reason given'}`));
  return h('td', { class: 'gpus', title: [...new Set(gpus.map((g) => g.name))].join(', ') },
    kinds.map((k) => h('div', { class: 'gpu-kind' }, k)), bad);
}

function nodeRow(n) {
  const problems = nodeProblems(n);
  const row = h('tr', { data: { node: n.node_id } },
    h('td', { class: 'id', title: n.address || null }, n.node_id),
    h('td', { class: stateClass(n.state) }, n.state),
    h('td', { class: 'intent' }, intentWords(n)),
    h('td', null, n.fabric || DASH),
    gpuCell(n),
    h('td', { class: 'num memory', title: 'available / total GiB' },
      `${gib(n.memory_available_bytes)} / ${gib(n.memory_total_bytes)}`),
    h('td', { class: 'version', title: n.version || null }, shortVersion(n.version)),
    h('td', { class: 'num' }, String(n.shards ?? 0)),
    h('td', { class: 'problems' }, problems.map((p) => h('div', null, p))));
  if (admin()) {
    const id = n.node_id;
    const held = n.cordoned || n.draining || n.drained;
    const btn = (action) => h('button', { type: 'button', data: { action, node: id } }, action);
    row.append(h('td', { class: 'actions' }, held ? btn('uncordon') : [btn('cordon'), btn('drain')]));
  }
  return row;
}

function modelProblems(m, draining) {
  const words = [];
  if (m.outdated) words.push(`rollout: ${m.outdated} outdated`);
  if (m.cannot_place) words.push(`cannot place: ${m.cannot_place}`);
  if (m.retry_in_s !== null && m.retry_in_s !== undefined)
    words.push(`${m.cannot_place ? '' : 'crash loop, '}next try in ${Math.round(m.retry_in_s)} s`);
  if (m.weights_missing) words.push('weights missing: no node reports its weights');
  for (const f of m.fetching || [])
    words.push(`fetching ${progressWords(f.progress) || 'its weights'} on ${f.node_id}`);
  for (const node of m.nodes || []) if (draining.has(node)) words.push(`node ${node} draining`);
  if (m.scaling && m.scaling.yielding) words.push(`yielding: ${m.scaling.yielding}`);
  return words;
}

function modelLink(name) {
  return h('a', { href: `#/model/${encodeURIComponent(name)}` }, name);
}

function modelRow(m, draining) {
  const sc = m.scaling;
  const range = sc ? `${sc.min}–${sc.max}${sc.pinned != null ? `, pinned ${sc.pinned}` : ''}` : null;
  const cell = (v, cls) => h('td', { class: `num ${cls || ''}` }, String(v ?? 0));
  const wanted = cell(m.wanted);
  if (range) {
    wanted.dataset.range = range; // shown by CSS after the number, kept out of its text
    wanted.title = `range ${range}`;
  }
  return h('tr', { data: { model: m.model } },
    h('td', { class: 'name' }, modelLink(m.model)),
    wanted,
    cell(m.ready, m.ready < m.wanted ? 'short' : ''),
    cell(m.starting),
    cell(m.failed, m.failed ? 'bad' : ''),
    cell(m.sleeping),
    h('td', { class: 'problems' }, modelProblems(m, draining).map((p) => h('div', null, p))));
}

function renderCounts(el, nodes, models, draining) {
  const by = {};
  for (const n of nodes) by[n.state] = (by[n.state] || 0) + 1;
  const sum = (k) => models.reduce((a, m) => a + (m[k] || 0), 0);
  const item = (key, n, label, cls) =>
    h('div', { class: `count ${cls || ''}`, data: { count: key } },
      h('span', { class: 'count-n' }, String(n)), h('span', { class: 'count-label' }, label));
  const states = ['Ready', 'Unreachable', 'Lost', ...Object.keys(by).filter(
    (s) => !['Ready', 'Unreachable', 'Lost'].includes(s))];
  const items = [item('nodes', nodes.length, 'nodes')];
  for (const s of states) items.push(item(`nodes-${s}`, by[s] || 0, s, by[s] ? stateClass(s) : 'zero'));
  const cordoned = nodes.filter((n) => n.cordoned && !n.draining && !n.drained).length;
  const drained = nodes.filter((n) => n.drained).length;
  if (cordoned) items.push(item('cordoned', cordoned, 'cordoned'));
  if (draining.size) items.push(item('draining', draining.size, 'draining'));
  if (drained) items.push(item('drained', drained, 'drained'));
  const full = models.filter((m) => m.ready >= m.wanted).length;
  items.push(item('models', `${full} / ${models.length}`, 'models at their count'));
  items.push(item('replicas', `${sum('ready')} / ${sum('wanted')}`, 'replicas ready / wanted'));
  items.push(item('starting', sum('starting'), 'starting'));
  items.push(item('failed', sum('failed'), 'failed', sum('failed') ? 'state-Failed' : 'zero'));
  items.push(item('sleeping', sum('sleeping'), 'sleeping'));
  const problems =
    nodes.filter((n) => n.state !== 'Ready' || nodeProblems(n).length || (n.gpus || []).some((g) => !g.healthy)).length +
    models.filter((m) => modelProblems(m, draining).length).length;
  items.push(item('problems', problems, 'problems', problems ? 'state-Failed' : 'zero'));
  el.replaceChildren(...items);
}

// --- model page: summary, replicas, failures, placement, bench -----------------------------

function modelView(name) {
  const q = encodeURIComponent(name);
  const summary = h('div', { id: 'model-summary', class: 'summary' });
  const replicasBody = h('tbody');
  const failures = h('section', { id: 'failures' }, h('h2', null, 'Last failures'));
  const placement = h('section', { id: 'placement' }, h('h2', null, 'Placement'));
  const bench = h('section', { id: 'bench' }, h('h2', null, 'Bench'));
  let known = false; // in the catalog at the last look: a removed model's placement is a 404
  const root = h('div', { class: 'model' },
    h('div', { class: 'view-head' }, h('h1', null, name)),
    summary,
    h('h2', null, 'Replicas'),
    h('table', { id: 'replicas', class: 'grid' },
      thead('replica', 'profile', 'state', 'why', 'nodes', 'in flight', 'breaker',
        'waiting / running', 'KV', 'cache hit', 'est. hit'), replicasBody),
    failures, placement, bench);
  return {
    name: 'model',
    root,
    wants: () => true,
    async load(ctx) {
      const first = ctx.what.has('first');
      const place = first || (known && ['nodes', 'replicas', 'intent'].some((w) => ctx.what.has(w)));
      const [reps, models, pl, b] = await Promise.all([
        get('/api/replicas'),
        get('/api/models'),
        place ? get(`/api/models/${q}/placement`) : undefined,
        first ? get(`/api/models/${q}/bench`) : undefined,
      ]);
      if (!ctx.current()) return false;
      if (models) {
        const m = (models.models || []).find((x) => x.model === name);
        known = Boolean(m);
        renderModelSummary(summary, name, m);
        renderFailures(failures, m ? m.failures || [] : []);
      }
      if (reps) {
        const f = document.createDocumentFragment();
        for (const r of reps.replicas || []) if (r.model === name) f.append(replicaRow(r));
        if (!f.childNodes.length) f.append(h('tr', null, h('td', { colspan: 11, class: 'empty' }, 'no replicas')));
        replicasBody.replaceChildren(f);
      }
      if (pl) renderPlacement(placement, pl);
      if (b) renderBench(bench, q, b.runs || []);
      return Boolean(reps && models && pl !== null && b !== null);
    },
  };
}

function renderModelSummary(el, name, m) {
  if (!m) {
    el.replaceChildren(h('p', { class: 'bad' }, `no model ${name} in the catalog`));
    return;
  }
  const line = `wanted ${m.wanted} · ready ${m.ready} · starting ${m.starting} · failed ${m.failed}` +
    ` · sleeping ${m.sleeping || 0}` + (m.outdated ? ` · outdated ${m.outdated}` : '');
  const sc = m.scaling;
  let scaling = null;
  if (sc) {
    scaling = `scaling ${sc.min}–${sc.max} replicas, ${sc.target} requests at once each; now ` +
      `${sc.in_flight} in flight, ${sc.waiting} waiting` +
      (sc.pinned != null ? `; pinned at ${sc.pinned}` : '') +
      (sc.last_change ? `; last change ${sc.last_change}` : '') +
      (sc.last_change_ago_s != null ? ` (${ago(sc.last_change_ago_s)})` : '');
  }
  const problems = modelProblems(m, new Set());
  fill(el,
    h('p', null, line),
    scaling && h('p', null, scaling),
    h('p', null, `nodes: ${(m.nodes || []).join(', ') || 'none'}`),
    problems.length ? h('div', { class: 'problems' }, problems.map((p) => h('div', null, p))) : null);
}

function replicaRow(r) {
  const t = r.traffic;
  const why = [];
  if (r.why) why.push(r.why);
  if (r.leaving) why.push(`leaving${r.leaving_why ? `: ${r.leaving_why}` : ''}`);
  if (r.healthy === false) why.push('not answering its health checks');
  if (r.verified === false) why.push('not yet verified');
  if (t && t.wedged) why.push(`wedged: ${t.wedged}`);
  const shards = r.shards || [];
  for (const s of shards)
    if (s.fetching) why.push(`fetching ${progressWords(s.fetching) || 'its weights'} on ${s.node_id}`);
  const nodes = shards.map((s) => s.node_id).join(', ');
  const shardTitle = shards.map((s) => `${s.node_id}: ${s.state}${s.detail ? ` (${s.detail})` : ''}`).join('\n');
  const wr = t && (t.waiting != null || t.running != null) ? `${num(t.waiting, 1)} / ${num(t.running, 1)}` : DASH;
  return h('tr', { data: { replica: r.replica_id } },
    h('td', { class: 'id' }, r.replica_id),
    h('td', { class: 'profile' }, r.profile, r.outdated ? h('span', { class: 'tag' }, 'outdated') : null),
    h('td', { class: stateClass(r.state), title: `for ${Math.round(r.state_since)} s` }, r.state),
    h('td', { class: 'why' }, why.map((w) => h('div', null, w))),
    h('td', { title: shardTitle || null }, nodes || DASH),
    h('td', { class: 'num' }, t ? String(t.in_flight) : DASH),
    h('td', { class: t && t.breaker !== 'closed' ? 'bad' : null }, t ? t.breaker : DASH),
    h('td', { class: 'num' }, wr),
    h('td', { class: 'num' }, t ? pct(t.kv_usage) : DASH),
    h('td', { class: 'num' }, t ? pct(t.cache_hit_rate) : DASH),
    h('td', { class: 'num' }, t ? pct(t.estimated_hit_rate) : DASH));
}

function renderFailures(el, list) {
  const items = list.map((f) => {
    const exit = [f.exit_code != null ? `exit code ${f.exit_code}` : '', f.signal ? `signal ${f.signal}` : '']
      .filter(Boolean).join(', ');
    const tail = (f.output_tail || []).join('\n');
    return h('div', { class: 'failure', data: { replica: f.replica_id } },
      h('div', { class: 'failure-head' },
        h('span', { class: 'when', title: new Date(f.at * 1000).toLocaleString() }, ago(f.ago_s)),
        ` · node ${f.node_id} · replica ${f.replica_id}`, exit ? ` · ${exit}` : ''),
      h('div', { class: 'reason' }, f.reason),
      tail ? h('pre', { class: 'output-tail' }, tail) : null);
  });
  fill(el, h('h2', null, 'Last failures'),
    items.length ? items : h('p', { class: 'empty' }, 'no failures recorded'));
}

function renderPlacement(el, p) {
  const needs = Object.entries(p.needs || {});
  const rows = document.createDocumentFragment();
  for (const c of p.candidates || [])
    rows.append(h('tr', { class: c.ok ? 'ok' : 'rejected', data: { node: c.node_id, profile: c.profile } },
      h('td', { class: 'id' }, c.node_id),
      h('td', null, c.profile),
      h('td', { class: c.ok ? 'good' : 'bad' }, c.ok ? 'yes' : 'no'),
      h('td', null, c.kind),
      h('td', null, c.reason),
      h('td', { class: 'num' }, c.ok ? num(c.score, 2) : '')));
  const running = (p.running || []).map((r) =>
    h('div', null, `${r.replica_id} (${r.profile}, ${r.state}${r.leaving ? ', leaving' : ''}) on ${r.nodes.join(', ')}`));
  fill(el,
    h('h2', null, 'Placement'),
    h('p', { class: 'summary' }, p.summary || ''),
    p.profile ? h('p', null, `a new replica would run profile ${p.profile}` +
      ((p.shards || []).length ? ` on ${p.shards.map((s) => s.node_id).join(', ')}` : '')) : null,
    needs.length ? h('div', { class: 'needs' }, h('h3', null, 'Needs per profile'),
      h('ul', null, needs.map(([prof, words]) => h('li', null, `${prof}: ${words}`)))) : null,
    running.length ? h('div', { class: 'running' }, h('h3', null, 'Running'), running) : null,
    h('h3', null, 'Candidates'),
    rows.childNodes.length
      ? h('table', { id: 'candidates', class: 'grid' },
        thead('node', 'profile', 'ok', 'kind', 'reason', 'score'), h('tbody', null, rows))
      : h('p', { class: 'empty' }, 'no node considered'));
}

function renderBench(el, q, runs) {
  const shown = runs.slice(0, 3).map((r, i) => {
    const target = r.target && typeof r.target === 'object'
      ? [r.target.kind, r.target.replica_id].filter(Boolean).join(' ') : r.target;
    const line = [r.date, r.profile && `profile ${r.profile}`, target && `target ${target}`,
      r.slo && `SLO ${r.slo}`, `capacity ${r.capacity ?? 'none (no level met the SLO)'}`]
      .filter(Boolean).join(' · ');
    return h('div', { class: 'bench-run', data: { run: i } },
      h('p', { class: 'bench-line' }, line),
      h('img', { class: 'bench-curve', src: `/api/models/${q}/bench.svg?run=${i}`,
        alt: `bench curves of run ${i}: throughput and TTFT/ITL p95 against concurrency` }));
  });
  fill(el, h('h2', null, 'Bench'),
    shown.length ? shown : h('p', { class: 'empty' }, 'no `llmgw ctl bench` result sent for this model yet'));
}

// --- traffic: four small charts per model over the last hour -------------------------------

function trafficView() {
  const section = h('section', { id: 'traffic' });
  const root = h('div', { class: 'traffic' },
    h('div', { class: 'view-head' }, h('h1', null, 'Traffic, last hour')), section);
  return {
    name: 'traffic',
    root,
    wants: (what) => what.includes('traffic'),
    async load(ctx) {
      const t = await get('/api/traffic');
      if (!t || !ctx.current()) return false;
      renderTraffic(section, t);
      return true;
    },
  };
}

const SERIES = [
  { key: 'requests', label: 'requests / step', get: (s) => s.requests, fmt: (v) => num(v) },
  { key: 'errors', label: 'errors / step', get: (s) => s.errors, fmt: (v) => num(v) },
  { key: 'ttft', label: 'TTFT p95', get: (s) => (s.ttft_p95_s || []).map((v) => (v == null ? null : v * 1000)),
    fmt: (v) => `${num(v)} ms` },
  { key: 'tokens', label: 'tokens / s', get: (s) => s.tokens_per_s, fmt: (v) => num(v, v < 10 ? 1 : 0) },
];

function renderTraffic(el, t) {
  const models = t.models || {};
  const names = Object.keys(models).sort();
  const busy = names.some((n) => (models[n].requests || []).some((v) => v > 0));
  const f = document.createDocumentFragment();
  const end = t.end ? new Date(t.end * 1000).toLocaleTimeString() : DASH;
  f.append(h('p', { class: 'traffic-note' },
    `summed over every router, one point per ${t.step_s || '?'} s, the last at ${end}`));
  if (!busy) f.append(h('p', { id: 'no-traffic', class: 'empty' }, 'no traffic in the last hour'));
  for (const name of names) {
    const s = models[name];
    f.append(h('div', { class: 'traffic-model', data: { model: name } },
      h('h2', null, modelLink(name)),
      h('div', { class: 'charts' }, SERIES.map((d) => chart(d, d.get(s) || [], t.points || 0)))));
  }
  el.replaceChildren(f);
}

// a line chart as inline SVG: nulls are gaps; x from -60 min (left) to now (right)
function chart(d, values, points) {
  const W = 300;
  const H = 70;
  const n = Math.max(points, values.length, 2);
  const finite = values.filter((v) => v !== null && v !== undefined && Number.isFinite(v));
  const max = finite.length ? Math.max(...finite) : 0;
  const top = max > 0 ? max : 1;
  const x = (i) => W - ((values.length - 1 - i) * W) / (n - 1); // the last value at "now"
  const y = (v) => H - 2 - (v / top) * (H - 6);
  let path = '';
  let pen = false;
  values.forEach((v, i) => {
    if (v === null || v === undefined || !Number.isFinite(v)) {
      pen = false;
      return;
    }
    path += `${pen ? 'L' : 'M'}${x(i).toFixed(1)} ${y(v).toFixed(1)}`;
    if (!pen && (i + 1 >= values.length || values[i + 1] == null)) path += 'h0.01'; // a lone point
    pen = true;
  });
  const box = svg('svg', { class: 'chart-svg', viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: 'none',
    role: 'img', 'aria-label': `${d.label}, last hour` });
  box.append(svg('line', { class: 'chart-base', x1: 0, y1: H - 2, x2: W, y2: H - 2, 'vector-effect': 'non-scaling-stroke' }));
  if (path) box.append(svg('path', { class: 'chart-line', d: path, 'vector-effect': 'non-scaling-stroke' }));
  let last = null;
  for (let i = values.length - 1; i >= 0; i--)
    if (values[i] !== null && values[i] !== undefined) { last = values[i]; break; }
  return h('figure', { class: `chart chart-${d.key}`, data: { series: d.key } },
    h('figcaption', null,
      h('span', { class: 'chart-label' }, d.label,
        h('span', { class: 'chart-peak' }, `peak ${finite.length ? d.fmt(max) : DASH}`)),
      h('span', { class: 'chart-value', title: 'the last value' }, last === null ? DASH : d.fmt(last))),
    box,
    h('div', { class: 'chart-axis' }, h('span', null, '-60 min'), h('span', null, 'now')));
}

// --- actions (admin): cordon, uncordon, drain, reload, each confirmed in <dialog> ----------

function confirmDialog(text) {
  const d = $('#confirm');
  if (d.open) return Promise.resolve(false);
  $('#confirm-text').textContent = text;
  d.returnValue = '';
  return new Promise((resolve) => {
    d.addEventListener('close', () => resolve(d.returnValue === 'yes'), { once: true });
    d.showModal();
    $('#confirm-no').focus();
  });
}

const VERBS = { cordon: 'Cordon', uncordon: 'Uncordon', drain: 'Drain' };

async function nodeAction(action, node) {
  if (!admin() || !VERBS[action]) return;
  if (!(await confirmDialog(`${VERBS[action]} node ${node}? (same as \`llmgw ctl ${action} ${node}\`)`))) return;
  const r = await api(`/api/nodes/${encodeURIComponent(node)}`, { method: 'POST', body: { intent: action } });
  if (r.ok) say(r.data.message || `${action} ${node}: done`);
  else failed(r, 'error');
}

async function reloadCatalog() {
  if (!admin()) return;
  if (!(await confirmDialog('Reload the catalog and the API keys? (same as `llmgw ctl reload`)'))) return;
  const r = await api('/api/reload', { method: 'POST', body: {} });
  if (r.ok) say([r.data.message || 'reloaded', ...(r.data.warnings || []).map((w) => `warning: ${w}`)]);
  else failed(r, 'error');
}

function onFleetClick(ev) {
  const b = ev.target.closest('button');
  if (!b) return;
  if (b.id === 'reload') reloadCatalog();
  else if (b.dataset.action) nodeAction(b.dataset.action, b.dataset.node);
}

// --- start ------------------------------------------------------------------------------

async function start() {
  $('#signin-form').addEventListener('submit', signIn);
  $('#signout').addEventListener('click', signOut);
  window.addEventListener('hashchange', route);
  // a page that is hidden, or left for another (kept in the back/forward cache), lets
  // its live feed go: a browser holds six connections to one server, and every tab's
  // feed would hold one; shown again, it opens the feed and reads what it missed
  document.addEventListener('visibilitychange', () => (document.hidden ? pause() : resume()));
  window.addEventListener('pagehide', pause);
  window.addEventListener('pageshow', (ev) => ev.persisted && resume());
  const r = await api('/api/session'); // role "" when not signed in
  if (r.ok && r.data.role) signedIn(r.data, false);
  else if (r.ok || r.status === 401) signedOut();
  else {
    signedOut();
    say(r.error, 'fetch');
  }
}

start();
