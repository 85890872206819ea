"""Who may say what: envelopes (X25519 + AES-GCM, Ed25519), chunk streams, TLS identities, the
provisioning of a deployment, the seen-message table and the gate every request passes."""
