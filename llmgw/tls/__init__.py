"""The private CA and the mutual-TLS contexts of the agent stream.

``ca`` issues certificates (cryptography); ``contexts`` builds ``ssl`` contexts
that trust only that CA.  Hostname verification reads subjectAltNames only, so
the server certificate must list every name *and IP* agents dial.
"""

from llmgw.tls.ca import (
    CA,
    CAError,
    CAFiles,
    CertificateInfo,
    describe_certificate,
    init_ca,
    issue_agent,
    issue_server,
    load_ca,
    validate_node_id,
)
from llmgw.tls.contexts import (
    PeerCertSource,
    TLSConfigError,
    certificate_names,
    client_context,
    peer_common_name,
    server_context,
)

__all__ = [
    "CA",
    "CAError",
    "CAFiles",
    "CertificateInfo",
    "PeerCertSource",
    "TLSConfigError",
    "certificate_names",
    "client_context",
    "describe_certificate",
    "init_ca",
    "issue_agent",
    "issue_server",
    "load_ca",
    "peer_common_name",
    "server_context",
    "validate_node_id",
]
