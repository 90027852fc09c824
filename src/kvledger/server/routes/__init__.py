"""The front's routes, one router per API: native (SGLang), OpenAI, sessions, admin and health,
tokenizer, generation control (pause, continue, weight updates), the ledger's live view, and LoRA
adapters (load, unload)."""

from . import admin, control, ledger_view, lora, native, openai, sessions, tokenizer

ROUTERS = [
    native.router, openai.router, sessions.router, admin.router, control.router, tokenizer.router,
    ledger_view.router, lora.router,
]  # fmt: skip
