"""HTTP over mutual TLS: the client side, the services' shared plumbing and the small HTTP/1.1
framing the hand-rolled stream clients share."""
