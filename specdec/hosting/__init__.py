"""The gRPC shell both model services share: request decoding, the servicer base
(Release, GetInfo), background hooks, and `main()` for a `Role`, on the server
bootstrap every specdec server shares (specdec.server, specdec.drain). The model
work itself is the engine's (the `engine` package). Nothing here depends on
which role it serves: the role packages pass that in (specdec.hosting.role)."""
