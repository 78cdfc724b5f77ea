//! One probe of one instance: a TCP connect or an HTTP GET.

use std::time::Duration;

use super::CheckKind;
use crate::model::instance::{Address, Instance};

/// Where and how to probe; a change of any part restarts the instance's check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub kind: CheckKind,
    pub host: String,
    pub port: u16,
    pub path: String,
    pub timeout: Duration,
    pub interval: Duration,
}

impl Target {
    pub fn new(instance: &Instance, spec: &super::CheckSpec, kind: CheckKind) -> Self {
        let host = match &instance.address {
            Address::Ip(ip) if ip.is_ipv6() => format!("[{ip}]"),
            address => address.to_string(),
        };
        Self {
            kind,
            host,
            port: instance.port,
            path: spec.path.clone(),
            timeout: spec.timeout,
            interval: spec.interval,
        }
    }
}

/// Runs one probe within the target's timeout; `Err` says why it failed, for the log.
pub async fn probe(target: &Target, http: &reqwest::Client) -> Result<(), String> {
    let attempt = async {
        match target.kind {
            CheckKind::None => Ok(()),
            CheckKind::Tcp => tokio::net::TcpStream::connect(format!("{}:{}", target.host, target.port))
                .await
                .map(drop)
                .map_err(|e| match e.kind() {
                    std::io::ErrorKind::ConnectionRefused => "connection refused".to_owned(),
                    _ => format!("connect failed: {e}"),
                }),
            CheckKind::Http => {
                let url = format!("http://{}:{}{}", target.host, target.port, target.path);
                let response = http.get(&url).send().await.map_err(|e| {
                    if e.is_connect() {
                        format!("GET {url}: connection refused or unreachable")
                    } else {
                        format!("GET {url}: {e}")
                    }
                })?;
                let status = response.status();
                if status.is_success() || status.is_redirection() {
                    Ok(())
                } else {
                    Err(format!("GET {url}: HTTP {}", status.as_u16()))
                }
            }
        }
    };
    match tokio::time::timeout(target.timeout, attempt).await {
        Ok(result) => result,
        Err(_) => Err(format!("timeout after {:?}", target.timeout)),
    }
}
