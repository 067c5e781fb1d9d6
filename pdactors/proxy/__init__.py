"""The proxy: one client request becomes a P leg and a D leg (or one engine's), over HTTP only.

The proxy never touches KV: it speaks OpenAI's HTTP API to clients and to the engines and writes
``kv_transfer_params``; the KV moves between the engines' actors. Reading order, along a
request's path: ``_serve`` (the actor: listeners, health loop, metrics), ``_app`` (routes),
``_asgi`` (the raw-ASGI completions door), ``_openai`` (the body rules), ``_completions`` (route,
place, admit), ``_flows`` (each flow of the exchange's record, :mod:`pdactors.core.exchange`,
performed: ``_p_first`` for P's token first and the fall-back to D, ``_answer`` for D's answer
and what follows its failure — a retry, a migration, the failure told), ``_legs`` (the calls
to P and D, nothing else), ``_exchange`` and ``_effects`` (an exchange as the IO code holds
it, and the one place the effects of its record are carried out), ``_engine_failures`` and
``_retry`` (what a failed leg tells the client, and which engine continues a migrated one),
``_kv_release`` (P told to free the KV it keeps for a D leg the record gave up),
``_bodies`` (what each engine is sent), ``_relay`` and ``_stream`` (D's stream relayed, made
the client's), ``_engine_http`` (h11 to the engines), ``_state`` and ``_health`` (the engines'
pools, counters and health), ``_pairs`` (which P may compute prompts for which D: their models
compared), ``_tracing`` (a span per request, its ``traceparent`` to both engines; on only with
an OTLP endpoint).
"""

from pdactors.proxy._serve import serve_proxy as serve_proxy
