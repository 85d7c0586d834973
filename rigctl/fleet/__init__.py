"""The fleet's llama.cpp builds beyond one host's: the CVE floor (:mod:`.advisories`), candidate builds
served beside the current one (:mod:`.candidate`), the paired gates (:mod:`.gates`) and the gated
upgrade and bisect that use them (:mod:`.upgrade`)."""
