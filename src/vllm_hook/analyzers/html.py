"""Self-contained interactive HTML views (no network, no external scripts): open the file in
any browser. The data travel as JSON inside the page; a small script draws the view from it.

- `token_view`: text coloured per token by one of several score series (the emotion tracker),
  a button per series, the scores of the token under the pointer, and a line chart.
- `heatmap_view`: a rows x columns table of coloured cells with the value under the pointer
  (causal tracing's layers x tokens).

When the script has drawn the page it sets `data-ready="1"` on `<body>`; a script error sets
`data-error` instead (the browser test reads both).
"""

from __future__ import annotations

import html
import json
import os
from typing import Sequence

import numpy as np

_STYLE = """
body{font:14px/1.5 system-ui,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:18px;margin:0 0 12px}
.bar button{margin:0 6px 6px 0;padding:3px 10px;border:1px solid #888;border-radius:4px;background:#f4f4f4;cursor:pointer}
.bar button.on{background:#333;color:#fff}
.text{white-space:pre-wrap;border:1px solid #ddd;padding:12px;border-radius:6px;line-height:2}
.tok{padding:1px 0;border-radius:3px;cursor:default}
.tok.gen{border-bottom:2px solid #555}
.detail{min-height:1.6em;margin:10px 0;font-family:ui-monospace,monospace;font-size:12px}
table.hm{border-collapse:collapse;font-size:11px}
table.hm td{width:34px;height:22px;text-align:center;border:1px solid #fff}
table.hm th{font-weight:normal;padding:2px 6px;white-space:pre}
table.hm thead th{writing-mode:vertical-rl;transform:rotate(180deg);text-align:left}
.legend{display:flex;align-items:center;gap:8px;font-size:12px;margin:8px 0}
.legend span.grad{display:inline-block;width:160px;height:12px;border:1px solid #ccc}
"""

# Shared by both views: a diverging colour for v in [-1, 1] (blue, white, red) and a
# sequential one for v in [0, 1] (white to dark blue); errors mark the page.
_COMMON_JS = """
window.onerror=function(m){document.body.dataset.error=String(m);};
function div(v){v=Math.max(-1,Math.min(1,v||0));var a=Math.abs(v);
  var c=v>=0?[214,39,40]:[31,119,180];
  return 'rgb('+c.map(function(x){return Math.round(255+(x-255)*a);}).join(',')+')';}
function seq(v){v=Math.max(0,Math.min(1,v||0));
  var c=[8,48,107];return 'rgb('+c.map(function(x){return Math.round(255+(x-255)*v);}).join(',')+')';}
function fmt(x){return (x>=0?'+':'')+x.toFixed(3);}
var D=JSON.parse(document.getElementById('data').textContent);
"""

_TOKEN_JS = """
var names=D.names, S=D.scores, T=D.tokens.length, sel=0;
var palette=['#d62728','#1f77b4','#2ca02c','#ff7f0e','#9467bd','#8c564b','#e377c2','#17becf','#bcbd22','#7f7f7f'];
var bar=document.getElementById('bar'), text=document.getElementById('text'), detail=document.getElementById('detail');
function maxabs(e){var m=0;for(var t=0;t<T;t++)m=Math.max(m,Math.abs(S[t][e]));return m||1;}
function paint(){var m=maxabs(sel);
  Array.prototype.forEach.call(bar.children,function(b,i){b.className=i===sel?'on':'';});
  for(var t=0;t<T;t++)text.children[t].style.background=div(S[t][sel]/m);
  chart();}
names.forEach(function(n,i){var b=document.createElement('button');b.textContent=n;
  b.style.borderLeft='6px solid '+palette[i%palette.length];
  b.onclick=function(){sel=i;paint();};bar.appendChild(b);});
D.tokens.forEach(function(s,t){var sp=document.createElement('span');sp.className='tok'+(D.boundary!==null&&t>=D.boundary?' gen':'');
  sp.textContent=s;sp.onmouseenter=function(){detail.textContent='token '+t+' '+JSON.stringify(s)+': '+
    names.map(function(n,e){return n+' '+fmt(S[t][e]);}).join('   ');};text.appendChild(sp);});
function chart(){var svg=document.getElementById('chart'),W=svg.clientWidth||800,H=180,P=28;
  var lo=Infinity,hi=-Infinity;S.forEach(function(r){r.forEach(function(v){lo=Math.min(lo,v);hi=Math.max(hi,v);});});
  if(!(hi>lo)){hi=lo+1;}var x=function(t){return P+(W-2*P)*(T>1?t/(T-1):0.5);},y=function(v){return H-P-(H-2*P)*(v-lo)/(hi-lo);};
  var out='<line x1="'+P+'" x2="'+(W-P)+'" y1="'+y(0)+'" y2="'+y(0)+'" stroke="#bbb"/>';
  if(D.boundary!==null)out+='<line x1="'+x(D.boundary-0.5)+'" x2="'+x(D.boundary-0.5)+'" y1="'+P+'" y2="'+(H-P)+'" stroke="#555" stroke-dasharray="4 3"/>';
  names.forEach(function(n,e){var pts=S.map(function(r,t){return x(t).toFixed(1)+','+y(r[e]).toFixed(1);}).join(' ');
    out+='<polyline fill="none" stroke="'+palette[e%palette.length]+'" stroke-width="'+(e===sel?3:1)+'" opacity="'+(e===sel?1:0.45)+'" points="'+pts+'"/>';});
  out+='<text x="'+P+'" y="14" font-size="11">'+hi.toFixed(2)+'</text><text x="'+P+'" y="'+(H-6)+'" font-size="11">'+lo.toFixed(2)+'</text>';
  svg.setAttribute('height',H);svg.innerHTML=out;}
paint();
document.body.dataset.ready='1';
"""

_HEATMAP_JS = """
var V=D.values, R=V.length, C=R?V[0].length:0, tbl=document.getElementById('hm'), detail=document.getElementById('detail');
var lo=Infinity,hi=-Infinity;V.forEach(function(r){r.forEach(function(v){if(v!==null){lo=Math.min(lo,v);hi=Math.max(hi,v);}});});
var diverging=lo<0&&hi>0, m=Math.max(Math.abs(lo),Math.abs(hi))||1;
function colour(v){if(v===null)return '#eee';return diverging?div(v/m):seq(hi>lo?(v-lo)/(hi-lo):1);}
var head=document.createElement('thead'),hr=document.createElement('tr');hr.appendChild(document.createElement('th'));
D.cols.forEach(function(c){var th=document.createElement('th');th.textContent=c;hr.appendChild(th);});
head.appendChild(hr);tbl.appendChild(head);var body=document.createElement('tbody');
V.forEach(function(row,i){var tr=document.createElement('tr'),th=document.createElement('th');th.textContent=D.rows[i];tr.appendChild(th);
  row.forEach(function(v,j){var td=document.createElement('td');td.style.background=colour(v);
    td.onmouseenter=function(){detail.textContent=D.rows[i]+' x '+JSON.stringify(D.cols[j])+': '+D.label+' '+(v===null?'n/a':v.toPrecision(4));};
    tr.appendChild(td);});body.appendChild(tr);});
tbl.appendChild(body);
document.getElementById('lo').textContent=diverging?(-m).toPrecision(3):lo.toPrecision(3);
document.getElementById('hi').textContent=diverging?m.toPrecision(3):hi.toPrecision(3);
document.getElementById('grad').style.background=diverging?'linear-gradient(90deg,'+div(-1)+','+div(0)+','+div(1)+')':'linear-gradient(90deg,'+seq(0)+','+seq(1)+')';
document.body.dataset.ready='1';
"""


def _page(title: str, body: str, data: dict, script: str) -> str:
    # "</" would end the data's <script> element early: JSON allows "<\\/" for it.
    payload = json.dumps(data, allow_nan=False).replace("</", "<\\/")
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head>\n<body><h1>{html.escape(title)}</h1>\n{body}\n"
            f"<script id=\"data\" type=\"application/json\">{payload}</script>\n"
            f"<script>{_COMMON_JS}{script}</script></body></html>\n")


def _write(path: str | os.PathLike, text: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return str(path)


def _finite(values: np.ndarray, what: str) -> np.ndarray:
    v = np.asarray(values, dtype=float)
    if np.isinf(v).any():
        raise ValueError(f"{what} holds infinite values; the view shows finite numbers (NaN: an empty cell)")
    return v


def token_view(path: str | os.PathLike, tokens: Sequence[str], scores, names: Sequence[str],
               title: str = "Token scores", boundary: int | None = None) -> str:
    """Write the per-token view: `scores` `[len(tokens), len(names)]`; tokens from `boundary`
    on are underlined as generated. Returns the path."""
    s = _finite(scores, "scores")
    if s.ndim != 2 or s.shape != (len(tokens), len(names)):
        raise ValueError(f"scores must be [tokens, names] = [{len(tokens)}, {len(names)}], got {list(s.shape)}")
    if np.isnan(s).any():
        raise ValueError("scores hold NaN; every token needs a score for every series")
    body = ('<div class="bar" id="bar"></div><div class="detail" id="detail">point at a token</div>'
            '<div class="text" id="text"></div><svg id="chart" width="100%" height="180"></svg>')
    data = {"tokens": [str(t) for t in tokens], "names": [str(n) for n in names], "scores": s.tolist(),
            "boundary": None if boundary is None else int(boundary)}
    return _write(path, _page(title, body, data, _TOKEN_JS))


def heatmap_view(path: str | os.PathLike, values, rows: Sequence[str], cols: Sequence[str],
                 title: str = "Heatmap", label: str = "value") -> str:
    """Write a rows x columns heatmap `values` `[len(rows), len(cols)]` (NaN: an empty cell);
    diverging colours around 0 when the values take both signs. Returns the path."""
    v = _finite(values, "values")
    if v.ndim != 2 or v.shape != (len(rows), len(cols)):
        raise ValueError(f"values must be [rows, cols] = [{len(rows)}, {len(cols)}], got {list(v.shape)}")
    body = ('<div class="legend"><span id="lo"></span><span class="grad" id="grad"></span><span id="hi"></span>'
            f'<span>{html.escape(label)}</span></div><div class="detail" id="detail">point at a cell</div>'
            '<table class="hm" id="hm"></table>')
    data = {"values": [[None if np.isnan(x) else float(x) for x in r] for r in v], "rows": [str(r) for r in rows],
            "cols": [str(c) for c in cols], "label": str(label)}
    return _write(path, _page(title, body, data, _HEATMAP_JS))
