"""agentkv-gateway: OpenAI's chat-completions and Responses APIs and Anthropic's Messages API
in front of the workers, so that any agent framework gets persistent Q4 agent memory without
code changes (gateway/app.py)."""
