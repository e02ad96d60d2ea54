"""ODP (LibreOffice Impress) to text (issue 32): kvblend's reading (a page per slide, titles as headings, tables as
pipe rows, notes) beside odfdo's own per-page formatted text (no title role, a table as a cell a line). A
30-slide deck written by odfdo: a title and a five-item list per slide, a 5-row table on every third. Best of 5.

    .venv/bin/python scripts/bench_odp.py
"""

import io
import time

from odfdo import Document, DrawPage, Frame, List, Table

from kvblend import conversion

deck = Document("presentation"); deck.body.clear()
for n in range(1, 31):
    page = DrawPage(f"p{n}", name=f"Slide {n}")
    page.append(Frame.text_frame(f"Pump station {n}", size=("20cm","2cm"), position=("1cm","1cm"), presentation_class="title"))
    page.append(Frame.text_frame(List([f"Station {n} pump {i}: rated {400+i} kPa" for i in range(5)]), size=("20cm","8cm"), position=("1cm","4cm"), presentation_class="outline"))
    if n % 3 == 0:
        t = Table("T", width=3, height=6); t.set_values([["Part","Cost","Site"]]+[[f"P{n}-{r}", r*3.5, "Halifax"] for r in range(5)])
        fr = Frame(size=("10cm","5cm"), position=("1cm","12cm")); fr.append(t); page.append(fr)
    deck.body.append(page)
b = io.BytesIO(); deck.save(b); data = b.getvalue()
def best(fn, reps=5):
    out=None; ts=[]
    for _ in range(reps):
        t0=time.perf_counter(); out=fn(); ts.append(time.perf_counter()-t0)
    return min(ts), out
t1, c = best(lambda: conversion.convert("odp", data))
t2, plain = best(lambda: "\n".join(p.get_formatted_text() for p in Document(io.BytesIO(data)).body.get_draw_pages()))
mb = len(data)/1e6
print(f"30 slides, {len(data)/1e3:.0f} KB: kvblend odp {t1*1000:.0f} ms ({t1*1000/30:.1f} ms a slide, {t1*1000/mb:.0f} ms/MB), {len(c.text)} chars; odfdo per page get_formatted_text {t2*1000:.0f} ms ({t2*1000/30:.1f} ms a slide), {len(plain)} chars, tables as cells a line each: {'| Part |' in plain}")
