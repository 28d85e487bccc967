"""Working from a laptop: a site's `[remote]` login host, reached through the user's own OpenSSH (issue 30).

`site` reads the `[remote]` table, `ssh` builds every ssh/rsync command line (pure, golden-tested) and reads
their failures, `travel` decides which local files go to the cluster, `forward` runs a command there: through
the login node's warm hpctrain server (`serve` there, `client` and `pipe` here, `wire` their frames) when one
answers, else over plain ssh.
"""
