//! The files in `deploy/`: the example config names every setting and loads, and the systemd
//! unit passes `systemd-analyze verify` and rates at most 2.0 in `systemd-analyze security`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::child::{Started, launch};

fn deploy(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy").join(file)
}

/// The settings `koder-dns serve --help` lists, as config file keys (`--dns-listen` → `dns_listen`).
fn setting_keys() -> Vec<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_koder-dns"))
        .args(["serve", "--help"])
        .output()
        .expect("run koder-dns serve --help");
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    let keys: Vec<String> = help
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("--"))
        .map(|l| l.split([' ', '<']).next().unwrap().replace('-', "_"))
        .filter(|k| k != "config" && k != "help")
        .collect();
    assert!(keys.len() >= 20, "too few settings read from --help: {keys:?}");
    keys
}

#[test]
fn example_config_lists_every_setting() {
    let text = std::fs::read_to_string(deploy("koder-dns.toml")).unwrap();
    for key in setting_keys() {
        let listed = text.lines().any(|l| {
            l.trim_start_matches("# ")
                .strip_prefix(&key)
                .is_some_and(|rest| rest.trim_start().starts_with('='))
        });
        assert!(listed, "deploy/koder-dns.toml does not list the setting {key}");
    }
}

/// With every commented setting switched on at the value the example gives, the server
/// starts: the example's values are ones the parser takes.
#[tokio::test]
async fn example_config_loads_with_every_setting_switched_on() {
    let text = std::fs::read_to_string(deploy("koder-dns.toml")).unwrap();
    let on: String = text
        .lines()
        .map(|l| match l.strip_prefix("# ") {
            Some(setting)
                if setting
                    .split_once(" = ")
                    .is_some_and(|(k, _)| k.chars().all(|c| c.is_ascii_lowercase() || c == '_') && k != "api_keys") =>
            {
                setting
            }
            _ => l,
        })
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(
        on.contains("\ndefault_ttl = "),
        "the example's settings were switched on:\n{on}"
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("koder-dns.toml");
    std::fs::write(&file, on).unwrap();
    // Flags beat the file: loopback ports of its own and a private data directory.
    let data = dir.path().join("data");
    match launch(&data, &["--config", file.to_str().unwrap()]).await {
        Started::Up(proc) => {
            let (status, stderr) = proc.terminate().await;
            assert_eq!(status.code(), Some(0), "{stderr}");
        }
        Started::Exited { status, stderr } => panic!("the example config was refused ({status}):\n{stderr}"),
    }
}

#[test]
#[ignore = "needs systemd-analyze (Debian systemd)"]
fn systemd_unit_verifies_and_is_sandboxed() {
    let unit = std::fs::read_to_string(deploy("koder-dns.service")).unwrap();
    // verify checks that ExecStart's binary exists: point it at the one cargo built, and
    // change nothing else.
    let dir = tempfile::tempdir().unwrap();
    let installed = "/usr/local/bin/koder-dns";
    assert!(unit.contains(&format!("ExecStart={installed} ")), "{unit}");
    let copy = dir.path().join("koder-dns.service");
    std::fs::write(&copy, unit.replace(installed, env!("CARGO_BIN_EXE_koder-dns"))).unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&copy)
        .output()
        .expect("run systemd-analyze (apt-get install systemd)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "systemd-analyze verify failed:\n{stderr}");
    assert!(
        !stderr.contains("koder-dns.service:"),
        "verify warned about the unit:\n{stderr}"
    );

    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=true", "--no-pager"])
        .arg(deploy("koder-dns.service"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let level: f64 = text
        .lines()
        .find_map(|l| l.split("Overall exposure level for koder-dns.service: ").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no exposure level in:\n{text}"));
    assert!(level <= 2.0, "exposure {level} > 2.0:\n{text}");
    // No capability unless an operator's drop-in grants one for port 53.
    assert!(unit.lines().any(|l| l == "CapabilityBoundingSet="), "{unit}");
    assert!(
        !unit.lines().any(|l| l.starts_with("AmbientCapabilities=CAP")),
        "{unit}"
    );
}

#[test]
#[ignore = "needs kubernetes-validate (PyPI, installed by tests/run.sh)"]
fn kubernetes_manifests_validate_against_the_api_schemas() {
    let out = Command::new("kubernetes-validate")
        .args(["--strict", "--no-warn"])
        .arg(deploy("kubernetes/koder-dns.yaml"))
        .output()
        .expect("run kubernetes-validate (pip install kubernetes-validate)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}{stderr}");
    for resource in ["statefulset/koder-dns", "service/koder-dns"] {
        assert!(
            stdout.contains(&format!("passed for resource {resource}")),
            "{stdout}{stderr}"
        );
    }
}
