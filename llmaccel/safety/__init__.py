"""Input filter, output filter and guard, the semantic guard and rate limits. Floor "a step" (the semantic guard
runs inside the engine's step); output_guard.py, which scores with the engine, sits on "the engine", and
guard_train.py, which runs it, on "tools that drive the engine". The server imports them; they never
import the server."""
