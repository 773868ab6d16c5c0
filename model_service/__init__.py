"""The gRPC shell both model services share: request decoding, the servicer base
(Release, GetInfo), background hooks, and `main()` for a `Role`, on the server
bootstrap every specdec server shares (specdec.runtime.server, specdec.runtime.drain). The model
work itself is the engine's (the `engine` package). Nothing here depends on
which role it serves: the role packages pass that in (model_service.role)."""
