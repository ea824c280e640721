"""Reading the files a process is pointed at by a flag (certificates, keys, token files), with an
error that names the flag, the file and the reason. Standard library only: the services' start-up
(specdec/startup.py, specdec/auth.py) and the client (which needs no torch) share it."""
from __future__ import annotations

import ssl


class StartupError(Exception):
    """The service cannot start; the message names the flag or file and the reason."""


def read_file(path: str, flag: str, mode: str = "rb"):
    """A file's contents, or StartupError naming the flag, the file and why it cannot be read."""
    try:
        with open(path, mode) as f:
            return f.read()
    except OSError as e:
        raise StartupError(f"{flag} {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise StartupError(f"{flag} {path}: not UTF-8 text") from None


def read_pem(path: str, flag: str) -> bytes:
    """A PEM file's bytes (certificate, key or CA bundle), or StartupError naming the flag: an empty
    or other file failed later, inside gRPC, with a message that named no flag."""
    data = read_file(path, flag)
    if b"-----BEGIN " not in data:
        raise StartupError(f"{flag} {path}: not a PEM file (no -----BEGIN line)")
    return data


def check_ca(path: str, flag: str) -> None:
    """StartupError naming the flag where a CA bundle holds no CA certificate (a key there went
    through to gRPC, which refused it later, behind its own log lines, or not at all)."""
    try:
        ssl.create_default_context(cafile=path)
    except (ssl.SSLError, ValueError) as e:
        raise StartupError(f"{flag} {path}: no CA certificate in it ({getattr(e, 'reason', None) or e})") from None


def check_pair(cert: str, key: str, cert_flag: str, key_flag: str) -> None:
    """StartupError naming both flags where a certificate and a key are not one pair, unencrypted
    (swapped files, a key of another certificate): gRPC's own refusal came at the first call."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.set_ciphers("DEFAULT:@SECLEVEL=0")  # the pairing only: a key this OpenSSL finds too small is gRPC's to judge
    try:
        context.load_cert_chain(cert, key, password=lambda: b"")  # never a prompt
    except (ssl.SSLError, ValueError) as e:
        raise StartupError(f"{cert_flag} {cert} and {key_flag} {key}: not a certificate and its private key, "
                           f"unencrypted as gRPC needs it ({getattr(e, 'reason', None) or e})") from None


def check_token(token: str, where: str) -> str:
    """The token, or StartupError naming `where` (a flag, and its file) when it is empty or holds
    what a gRPC metadata value cannot carry (a line break, a control or non-ASCII character: gRPC
    refused it at the first call, in a traceback). The token itself is never in the message."""
    if not token:
        raise StartupError(f"{where}: the token is empty")
    if not all(" " <= c <= "~" for c in token):
        raise StartupError(f"{where}: the token must be one line of printable ASCII (no line breaks, control or "
                           "non-ASCII characters), as an authorization header carries it")
    return token


def read_token(path: str, flag: str = "token file") -> str:
    """The token in a file (surrounding whitespace stripped); StartupError naming the flag and the
    file when it cannot be read (missing, a directory, not text), is empty, or holds what a gRPC
    metadata value cannot carry (a line break, a control or non-ASCII character: gRPC refused it
    at the first call, in a traceback)."""
    token = read_file(path, flag, "r").strip()
    if not token:
        raise StartupError(f"{flag} {path}: the file is empty")
    return check_token(token, f"{flag} {path}")
