//! An edge consumer: follows the registry's routing table and rewrites a routing file
//! atomically on every change, so a proxy reloading it never reads half a file.
//!
//! ```text
//! KODER_DNS_API_KEY=... cargo run --example routing_file -- \
//!     http://10.0.0.1:8053,http://10.0.0.2:8053 /etc/haproxy/koder.map [haproxy|json]
//! ```
//!
//! `haproxy` writes a map file, one `<domain> <address>:<port>` line per healthy instance
//! (conflicting domains are left out and reported: the edge must not mix services silently);
//! `json` writes the whole view, unhealthy instances and conflicts included.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use koder_dns::client::{Client, Route, Watcher};

fn haproxy_map(routes: &[Route]) -> String {
    let mut map = String::new();
    for route in routes {
        if route.conflict {
            eprintln!("{}: claimed by {:?}; not routed", route.domain, route.services);
            continue;
        }
        for instance in route.instances.iter().filter(|i| i.healthy) {
            let host = if instance.address.contains(':') {
                format!("[{}]", instance.address)
            } else {
                instance.address.clone()
            };
            map.push_str(&format!("{} {host}:{}\n", route.domain, instance.port));
        }
    }
    map
}

/// Writes beside the target, syncs, then renames over it: readers see the old file or the new.
fn write_atomically(path: &Path, contents: &str) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let mut file = std::fs::File::create(&tmp)?;
    file.write_all(contents.as_bytes())?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(urls), Some(output)) = (args.next(), args.next()) else {
        anyhow::bail!("usage: routing_file URL[,URL...] OUTPUT [haproxy|json]");
    };
    let format = args.next().unwrap_or_else(|| "haproxy".to_owned());
    anyhow::ensure!(
        format == "haproxy" || format == "json",
        "format is haproxy or json, not {format:?}"
    );
    let key = std::env::var("KODER_DNS_API_KEY").map_err(|_| anyhow::anyhow!("set KODER_DNS_API_KEY"))?;
    let urls = urls.split(',').map(str::to_owned).collect();
    let client = Arc::new(Client::new(urls, key, Duration::from_secs(10))?);
    let mut watcher = Watcher::new(client, Duration::from_secs(300));
    loop {
        let routes = watcher.next().await?;
        let contents = if format == "json" {
            serde_json::to_string_pretty(&routes)? + "\n"
        } else {
            haproxy_map(&routes)
        };
        write_atomically(Path::new(&output), &contents)?;
        println!("{output}: {} route(s)", routes.len());
    }
}
