"""Cross-silo task gateway: one mutual-TLS door between a task initiator and data-holding parties.

Modules: ``crypto`` (keys, envelopes), ``provision`` (CA, certificates, roster), ``replay``
(seen-message table), ``routing`` (the mapping table and tasks), ``rules`` (processing-rule registry),
``privacy`` (minimum group size and privacy budget), ``tlsid`` (which identity a certificate names),
``executor`` (per-task isolated process), ``rayexec`` (the same as a Ray actor), ``stream``
(chunked result streams), ``party`` (party agent), ``app`` (gateway service), ``client`` (initiator).
"""
