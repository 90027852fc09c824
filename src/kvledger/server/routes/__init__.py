"""The front's routes, one router per API: native (SGLang), OpenAI, sessions, admin and health,
tokenizer, generation control (pause, continue, weight updates), and the ledger's live view."""

from . import admin, control, ledger_view, native, openai, sessions, tokenizer

ROUTERS = [
    native.router, openai.router, sessions.router, admin.router, control.router, tokenizer.router,
    ledger_view.router,
]  # fmt: skip
