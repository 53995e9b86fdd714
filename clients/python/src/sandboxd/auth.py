"""Google ID tokens for a sandboxd deployed behind Cloud Run IAM
(`use_google_auth=True`): the token goes in `Authorization: Bearer` of every
WebSocket upgrade, where Cloud Run's front end checks it (the `run.invoker`
role); sandboxd itself accepts and ignores the header."""

from __future__ import annotations

from urllib.parse import urlparse


def audience_for(url: str) -> str:
    """The ID token's audience: the service's `https://host` (as Cloud Run expects)."""
    netloc = urlparse(url).netloc
    if not netloc:
        raise ValueError(f"cannot derive an ID token audience from {url!r}: no host")
    return f"https://{netloc}"


def fetch_id_token(url: str) -> str:
    """An ID token for `url`'s service from Application Default Credentials:
    the user's credentials (`gcloud auth application-default login`) when they
    carry an ID token, otherwise the metadata server or a service-account key
    (`google.oauth2.id_token.fetch_id_token`). Needs the `google-auth` extra."""
    try:
        import google.auth
        import google.auth.exceptions
        from google.auth.transport.requests import Request
        from google.oauth2 import id_token
    except ImportError as err:  # pragma: no cover - depends on the extra
        raise ImportError(
            "use_google_auth=True needs google-auth: pip install 'sandboxd[google-auth]'"
        ) from err
    audience = audience_for(url)
    request = Request()
    try:
        credentials, _ = google.auth.default()
        credentials.refresh(request)  # type: ignore[no-untyped-call]
        token = getattr(credentials, "id_token", None)
        if token:
            return str(token)
    except google.auth.exceptions.GoogleAuthError:
        pass
    return str(id_token.fetch_id_token(request, audience))  # type: ignore[no-untyped-call]
