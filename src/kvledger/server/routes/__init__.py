"""The front's routes, one router per API: native (SGLang), OpenAI, sessions, admin and health, tokenizer."""

from . import admin, native, openai, sessions, tokenizer

ROUTERS = [native.router, openai.router, sessions.router, admin.router, tokenizer.router]
