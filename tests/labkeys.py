"""Host-key rotation on a lab rig, for the tests that prove a changed key is refused."""

# Regenerates every host key sshd serves, keeping the originals aside; then reloads sshd.
ROTATE_HOST_KEYS = r"""
set -eu
keys=$(sshd -T | awk '$1 == "hostkey" {print $2}')
tar -cPpf /root/.rigctl-test-host-keys.tar $(for key in $keys; do echo "$key" "$key.pub"; done)
for key in $keys; do
    kind=$(ssh-keygen -l -f "$key" | awk '{print tolower($NF)}' | tr -d '()')
    rm -f "$key" "$key.pub"
    ssh-keygen -q -t "$kind" -N '' -f "$key"
done
kill -HUP "$(cat "$(sshd -T | awk '$1 == "pidfile" {print $2}')")"
"""
RESTORE_HOST_KEYS = r"""
set -eu
tar -xPpf /root/.rigctl-test-host-keys.tar
rm /root/.rigctl-test-host-keys.tar
kill -HUP "$(cat "$(sshd -T | awk '$1 == "pidfile" {print $2}')")"
"""
