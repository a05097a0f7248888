"""Calculator team app: a planner, a worker with a calculator tool (the OpenAI SDK's tool loop) and a critic in JSON
mode, the shape of app users bring (README.md)."""
