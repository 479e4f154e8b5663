"""Chat over a document, answered at full precision and at a chosen KV precision side by side.

`session.py` holds the conversation (`ChatSession`: turns, caches reused across turns, errors a user can
cause); `lane.py` one precision's side of it (its cache, the ids it holds, its answer decoded a token at a
time so two lanes stream together).
"""
