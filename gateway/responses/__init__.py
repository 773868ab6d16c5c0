"""The Responses API's own parts: the translation onto the chat path and its events
(gateway.responses.translate), and the stored responses (gateway.responses.kept)."""
