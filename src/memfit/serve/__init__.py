"""`memfit serve`: a local page to play with a plan. Pick the model, GPU and setup; the breakdown chart, the
ladder and the verdict follow, computed exactly as `memfit plan --json` computes them.

memfit.serve.core holds what the page computes and needs no web framework; memfit.serve.web is the Starlette
application and the uvicorn runner (the optional `serve` extra: pip install 'memfit[serve]'). Importing this
package imports neither."""

from .core import InputError, command_line, form_fields, options, plan_page

__all__ = ["InputError", "command_line", "form_fields", "options", "plan_page"]
