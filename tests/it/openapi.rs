//! `GET /api/v1/openapi.json`: every route described, and schemathesis (PyPI) finding no
//! server error and no response outside the description against the live server.

use std::process::Command;

use serde_json::Value;

use crate::common::{self, KEY};

#[tokio::test]
async fn openapi_describes_every_route_with_its_errors() {
    let server = common::start().await;
    let (status, doc) = server.get("/api/v1/openapi.json").await;
    assert_eq!(status, 200, "{doc}");
    assert_eq!(doc["openapi"], "3.1.0");
    let paths: Vec<&str> = doc["paths"].as_object().unwrap().keys().map(String::as_str).collect();
    for route in [
        "/api/v1/services",
        "/api/v1/services/register",
        "/api/v1/services/heartbeat",
        "/api/v1/services/deregister",
        "/api/v1/services/export",
        "/api/v1/services/drift",
        "/api/v1/routes",
        "/api/v1/sd/prometheus",
        "/api/v1/openapi.json",
    ] {
        assert!(paths.contains(&route), "{route} is not described: {paths:?}");
    }
    let register = &doc["paths"]["/api/v1/services/register"]["post"];
    for status in ["200", "400", "401", "503", "507"] {
        assert!(
            register["responses"][status].is_object(),
            "register {status}: {register}"
        );
    }
    let error: &Value = &doc["components"]["schemas"]["ErrorBody"];
    assert_eq!(error["required"], serde_json::json!(["error", "message"]), "{error}");
    assert!(doc["components"]["securitySchemes"]["api_key"].is_object());
    // Like the rest of the API, the document needs the key.
    let anonymous = server
        .http
        .get(server.url("/api/v1/openapi.json"))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401);
}

#[tokio::test]
#[ignore = "needs schemathesis (PyPI, installed by tests/run.sh)"]
async fn schemathesis_finds_no_server_error_and_no_response_outside_the_schema() {
    let server = common::start().await;
    let url = server.url("/api/v1/openapi.json");
    // schemathesis keeps a cache in its working directory: not in the repository.
    let scratch = tempfile::tempdir().unwrap();
    let cwd = scratch.path().to_owned();
    let out = tokio::task::spawn_blocking(move || {
        Command::new("schemathesis")
            .current_dir(cwd)
            .args(["run", &url, "--header", &format!("X-API-Key: {KEY}")])
            .args([
                "--checks",
                "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
                "--max-examples",
                "30",
                "--seed",
                "1",
            ])
            .output()
            .expect("run schemathesis (pip install schemathesis)")
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "schemathesis failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("passed"), "{stdout}");
}
