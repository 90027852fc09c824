"""The front's routes, one router per API: native (SGLang), OpenAI, sessions, admin and health."""

from . import admin, native, openai, sessions

ROUTERS = [native.router, openai.router, sessions.router, admin.router]
