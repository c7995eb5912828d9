"""Reports people look at: a self-contained HTML page (plotly, inlined) and a static PNG (matplotlib).

    from memfit.report import write_html, write_png
    write_html(plan, "report.html", trace=traced)   # trace: optional, adds the timeline and the top modules
    write_png(plan, "report.png")

plotly and matplotlib are imported when a report is drawn, not when this package is imported.
"""

from .html import render_html, write_html
from .png import png_size, write_png

__all__ = ["png_size", "render_html", "write_html", "write_png"]
