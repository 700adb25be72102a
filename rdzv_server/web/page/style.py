"""The status page's stylesheet (inline in every page: no second request, no build step)."""
from __future__ import annotations

CSS = """
:root{--fg:#1f2328;--muted:#656d76;--line:#d0d7de;--soft:#f6f8fa;--bg:#fff;--link:#0969da;
--green:#1a7f37;--green-bg:#dafbe1;--amber:#9a6700;--amber-bg:#fff8c5;--orange:#bc4c00;--orange-bg:#fff1e5;
--red:#cf222e;--red-bg:#ffebe9;--blue:#0969da;--blue-bg:#ddf4ff;--grey:#6e7781;--grey-bg:#eaeef2;
--c-green:#2da44e;--c-amber:#d4a72c;--c-orange:#e16f24;--c-red:#cf222e;--c-blue:#0969da;--c-grey:#8c959f}
*{box-sizing:border-box}body{margin:0;font:14px/1.45 system-ui,sans-serif;color:var(--fg);background:var(--soft)}
a{color:var(--link);text-decoration:none}a:hover{text-decoration:underline}
.mono,code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:13px}
.muted{color:var(--muted)}.nowrap{white-space:nowrap}.empty{padding:10px 12px;color:var(--muted)}
.top{display:flex;align-items:baseline;gap:24px;flex-wrap:wrap;padding:14px 28px;background:#24292f;color:#f6f8fa}
.top h1{font-size:18px;margin:0;font-weight:600}.top a{color:#f6f8fa}.top .muted{color:#adbac7}.right{margin-left:auto}
main{padding:20px 28px 40px;max-width:1500px}
h2{font-size:15px;margin:22px 0 8px}h3{font-size:13px;margin:16px 0 6px;color:var(--muted);
text-transform:uppercase;letter-spacing:.04em}
table{border-collapse:collapse;width:100%;background:var(--bg)}
th,td{text-align:left;padding:6px 10px;border-bottom:1px solid var(--line);vertical-align:baseline}
th{font-size:12px;font-weight:600;color:var(--muted);background:var(--soft)}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}tr:last-child td{border-bottom:0}
.box{border:1px solid var(--line);border-radius:6px;overflow:hidden;background:var(--bg)}
.job{border:1px solid var(--line);border-left:6px solid var(--grey);border-radius:6px;background:var(--bg);
padding:14px 18px 16px;margin:0 0 18px}
.job>header{display:flex;align-items:center;gap:12px;flex-wrap:wrap}
.job>header .id{font-size:16px;font-weight:600}
.stats{display:flex;flex-wrap:wrap;gap:8px 28px;margin:10px 0 4px}
.stat .k{display:block;font-size:11px;color:var(--muted);text-transform:uppercase;letter-spacing:.04em}
.stat .v{font-size:15px;font-weight:600;font-variant-numeric:tabular-nums}
.reason{margin:6px 0 0;color:var(--fg)}.warns{margin:6px 0 0;color:var(--orange);font-weight:500}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;font-weight:600;
border:1px solid transparent;white-space:nowrap}
.dot{display:inline-block;width:10px;height:10px;border-radius:50%;background:var(--grey)}
.h-green{--c:var(--c-green)}.h-amber{--c:var(--c-amber)}.h-orange{--c:var(--c-orange)}
.h-red{--c:var(--c-red)}.h-blue{--c:var(--c-blue)}.h-grey{--c:var(--c-grey)}
.job[class*=h-]{border-left-color:var(--c)}.dot[class*=h-]{background:var(--c)}
.s-running,.s-member,.s-ok{color:var(--green);background:var(--green-bg);border-color:#aceebb}
.s-waiting,.s-spare{color:var(--amber);background:var(--amber-bg);border-color:#eac54f}
.s-failed,.s-excluded{color:var(--red);background:var(--red-bg);border-color:#ffcecb}
.s-succeeded{color:var(--blue);background:var(--blue-bg);border-color:#b6e3ff}
.s-slow{color:var(--orange);background:var(--orange-bg);border-color:#ffb77c}
.goodput{margin-top:2px;padding-top:8px;border-top:1px dashed var(--line)}
.s-closed,.s-gone,.s-ended{color:var(--grey);background:var(--grey-bg);border-color:#d0d7de}
.bar{display:inline-block;width:64px;height:8px;border-radius:4px;background:var(--grey-bg);
vertical-align:middle;margin-right:8px;overflow:hidden}
.bar i{display:block;height:100%;background:var(--green)}.bar.mid i{background:var(--orange)}
.bar.full i{background:var(--red)}.warn-text{color:var(--orange);font-weight:600}
.bad-text{color:var(--red);font-weight:600}tr.ev-bad td{background:var(--red-bg)}
tr.ev-bad td.kind{color:var(--red);font-weight:600}tr.ev-warn td.kind{color:var(--orange);font-weight:600}
tr.ev-good td.kind{color:var(--green)}td.kind{white-space:nowrap}td.msg{width:50%}.chips{margin-top:2px}
.chip{display:inline-block;margin:1px 4px 1px 0;padding:0 6px;border-radius:4px;background:var(--soft);
border:1px solid var(--line);font-size:11.5px;color:var(--muted)}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(420px,1fr));gap:18px}
.kv td:first-child{color:var(--muted);width:40%}.more{display:inline-block;margin-top:10px;font-weight:500}
pre{margin:0;white-space:pre-wrap;font-size:12px}
table.summary td,table.summary th{white-space:nowrap}table.summary td.note{white-space:normal;width:30%}
svg.history{display:block;width:100%;max-width:1200px;height:auto;margin:10px 0 4px}
.pager{margin:8px 0;color:var(--muted)}.pager a{margin:0 6px}.cut{padding:6px 12px;color:var(--muted)}
"""
