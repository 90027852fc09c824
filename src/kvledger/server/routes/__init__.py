"""The front's routes, one router per API: native (SGLang), OpenAI, sessions, admin and health,
tokenizer, and the ledger's live view."""

from . import admin, ledger_view, native, openai, sessions, tokenizer

ROUTERS = [native.router, openai.router, sessions.router, admin.router, tokenizer.router, ledger_view.router]
