//! The Rust client over https: the proxy's `[server] tls` listener with a private CA and a
//! required client certificate. Certificates are made here with rcgen, on loopback.

mod support;

use std::path::Path;

use fencegate::client::{ClientOptions, ClientTls, Fence, FenceResult, FencedHttp};
use fencegate::config::Config;
use fencegate::token::Token;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use support::{Double, config_text};

struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        Ca {
            issuer: CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap(),
        }
    }

    /// Writes `NAME.pem` and `NAME.key` of a new leaf into `dir`.
    fn leaf(&self, dir: &Path, name: &str, dns: &str, usage: ExtendedKeyUsagePurpose) {
        let mut params = CertificateParams::new(vec![dns.to_string()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).unwrap();
        std::fs::write(dir.join(format!("{name}.key")), key.serialize_pem()).unwrap();
    }
}

#[tokio::test]
async fn fenced_requests_go_over_https_with_a_private_ca_and_a_client_certificate() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ca = Ca::new("test ca");
    ca.leaf(
        d,
        "server",
        "localhost",
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    ca.leaf(
        d,
        "client",
        "client.test",
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    std::fs::write(d.join("ca.pem"), ca.issuer.pem()).unwrap();
    let anchor = "trusted_proxies = [\"127.0.0.1\"]\n";
    let text = config_text(double.addr, "10s", "0s", "10s").replace(
        anchor,
        &format!(
            "{anchor}tls = {{ cert = \"server.pem\", key = \"server.key\", client_ca = \"ca.pem\" }}\n"
        ),
    );
    let running = support::start(Config::parse(&text, d).expect("config")).await;
    let base = format!("https://localhost:{}", running.proxy_addr.port());
    let fence = Fence::new("report/july", Token::new(0, 1));
    let with = |tls: Option<ClientTls>| {
        FencedHttp::with_options(
            &base,
            ClientOptions {
                tls,
                ..ClientOptions::default()
            },
        )
        .unwrap()
    };

    // The private CA and the client certificate: through the fence.
    let tls = ClientTls::new(
        Some(&d.join("ca.pem")),
        Some((&d.join("client.pem"), &d.join("client.key"))),
    )
    .expect("client tls");
    let r = with(Some(tls)).put(&fence, "/reports/july/a", "x").await;
    assert!(matches!(r, Ok(FenceResult::Applied { .. })), "{r:?}");
    assert_eq!(double.seen().len(), 1);

    // Without the client certificate, or trusting only the built-in roots: no request.
    let no_identity = ClientTls::new(Some(&d.join("ca.pem")), None).expect("tls");
    for http in [with(Some(no_identity)), with(None)] {
        let r = http.put(&fence, "/reports/july/b", "x").await;
        assert!(
            matches!(
                r,
                Ok(FenceResult::Transient { .. } | FenceResult::Unknown { .. })
            ),
            "{r:?}"
        );
    }
    assert_eq!(double.seen().len(), 1, "nothing else reached the upstream");

    // Files that are not what they should be are refused with their name.
    let e = ClientTls::new(Some(&d.join("server.key")), None).unwrap_err();
    assert!(e.to_string().contains("server.key"), "{e}");
    let e = ClientTls::new(
        Some(&d.join("ca.pem")),
        Some((&d.join("client.pem"), &d.join("server.key"))),
    )
    .unwrap_err();
    assert!(e.to_string().contains("does not fit"), "{e}");
    running.shutdown().await;
}
