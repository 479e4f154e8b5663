"""Chat over a document, answered at full precision and at a chosen KV precision side by side.

`session.py` holds the conversation (`ChatSession`: turns, caches reused across turns, errors a user can
cause); `lane.py` one precision's side of it (its cache, the ids it holds, its answer decoded a token at a
time so two lanes stream together); `compare.py` scores each finished turn's answers under both caches, token
by token; `questions.py` holds suggested questions for the bundled sample; `planted.py` plants a fact in the
user's document and asks for it, in a session of its own.
"""
