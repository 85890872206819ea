// Starts swagger-ui on /docs (a file, not an inline script: the Content-Security-Policy allows
// scripts from this origin only). State changes of the REST API take JSON: every request that
// is not a read says so, as the CLI does.
window.addEventListener("load", () => {
  const root = document.getElementById("swagger-ui");
  window.ui = SwaggerUIBundle({
    url: root.dataset.openapiUrl,
    dom_id: "#swagger-ui",
    deepLinking: true,
    requestInterceptor: (request) => {
      if (request.method && !["GET", "HEAD"].includes(request.method.toUpperCase())) {
        request.headers = request.headers || {};
        if (!request.headers["Content-Type"]) request.headers["Content-Type"] = "application/json";
        if (request.body === undefined || request.body === null) request.body = "{}";
      }
      return request;
    },
  });
});
