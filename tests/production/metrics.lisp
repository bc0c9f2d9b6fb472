;;;; metrics.lisp -- the metrics URL of both front ends (GALLOP:METRICS-APP,
;;;; GALLOP:CREATE-METRICS-DISPATCHER), read as Prometheus reads it: the text
;;;; is parsed by Debian's python3-prometheus-client
;;;; (text_string_to_metric_families, run with /usr/bin/python3), and its
;;;; counters must move by exactly the requests, and the octets, a real
;;;; client sent over real sockets.  The format itself (GALLOP.CORE::WRITE-
;;;; METRICS) and the bucket of a duration are tested without a server.
;;;;
;;;; Internals of GALLOP.CORE reached on purpose: the per-answer counts'
;;;; layout and WRITE-METRICS (metrics.lisp), DURATION-BUCKET, METHOD-INDEX
;;;; and STATUS-CLASS: the format is tested on made-up counts, without a
;;;; server.

(in-package #:gallop-tests)

(in-suite production)

;;; Reading the text as Prometheus does

(defparameter *prometheus-parser*
  "import sys
from prometheus_client.parser import text_string_to_metric_families
for family in text_string_to_metric_families(sys.stdin.read()):
    print('T', family.name, family.type)
    for s in family.samples:
        labels = ','.join('%s=%s' % item for item in sorted(s.labels.items()))
        print('S', '%s{%s}' % (s.name, labels), repr(s.value))
"
  "Prints each family as T NAME TYPE and each of its samples as S NAME{LABELS}
VALUE, the labels sorted by name.")

(defun parse-metrics (text)
  "TEXT parsed by prometheus_client: a hash table from sample keys
\(\"name{label=value,...}\", labels sorted) and from \"#type name\" (the
family's name as the parser gives it) to values and types.  NIL, and the
parser's error output, when it failed."
  (multiple-value-bind (output error status)
      (uiop:run-program (list "/usr/bin/python3" "-c" *prometheus-parser*)
                        :input (make-string-input-stream text)
                        :output :string :error-output :string :ignore-error-status t)
    (if (/= 0 status)
        (values nil error)
        (let ((table (make-hash-table :test 'equal))
              (*read-default-float-format* 'double-float))
          (with-input-from-string (in output)
            (loop for line = (read-line in nil)
                  while line
                  do (destructuring-bind (kind name value)
                         (uiop:split-string line :separator " ")
                       (if (string= kind "T")
                           (setf (gethash (format nil "#type ~A" name) table) value)
                           (setf (gethash name table)
                                 (let ((number (read-from-string value)))
                                   (if (= number (round number)) (round number) number)))))))
          table))))

(defun metric-value (table key)
  "The value of the sample KEY in TABLE (PARSE-METRICS), 0 when absent."
  (gethash key table 0))

(defun answers-key (method class)
  (format nil "gallop_http_requests_total{code=~A,method=~A}" class method))

(defparameter *expected-families*
  '(("gallop_http_requests" "counter")
    ("gallop_http_request_duration_seconds" "histogram")
    ("gallop_received_bytes" "counter") ("gallop_sent_bytes" "counter")
    ("gallop_open_connections" "gauge") ("gallop_idle_connections" "gauge")
    ("gallop_active_connections" "gauge") ("gallop_suspended_requests" "gauge")
    ("gallop_pool_threads" "gauge") ("gallop_pool_run_permits" "gauge")
    ("gallop_shed" "counter") ("gallop_timeouts" "counter") ("gallop_aborted" "counter")
    ("gallop_stop_cut" "counter")
    ("gallop_tls_handshakes" "counter")
    ("gallop_head_budget_used_bytes" "gauge") ("gallop_head_budget_bytes" "gauge")
    ("gallop_body_budget_used_bytes" "gauge") ("gallop_body_budget_bytes" "gauge")
    ("gallop_body_disk_budget_used_bytes" "gauge") ("gallop_body_disk_budget_bytes" "gauge"))
  "Families every metrics text has, as the parser names them, and their types.")

(defun check-metric-families (what table)
  (dolist (family *expected-families*)
    (destructuring-bind (name type) family
      (is (equal type (gethash (format nil "#type ~A" name) table))
          "~A: family ~A is ~S, not a ~A" what name
          (gethash (format nil "#type ~A" name) table) type))))

;;; A client that knows every octet it sent and received

(defun closing-get (path)
  "A GET of PATH that asks the server to close after its answer."
  (crlf (format nil "GET ~A HTTP/1.1" path) "Host: 127.0.0.1" "Connection: close"))

(defun metrics-exchange (port request)
  "Send REQUEST (a string) on a new connection to PORT and read until the
server closes: every octet of its answer."
  (let ((socket (connect port)))
    (unwind-protect (progn (send socket request)
                           (coerce (read-to-eof (usocket:socket-stream socket))
                                   '(simple-array (unsigned-byte 8) (*))))
      (usocket:socket-close socket))))

(defun exchange-status (octets)
  (parse-integer (map 'string #'code-char (subseq octets 9 12))))

(defun exchange-body (octets)
  "The body of the answer OCTETS (after its head's empty line), as a string."
  (let ((end (search #(13 10 13 10) octets)))
    (map 'string #'code-char (subseq octets (+ end 4)))))

(defun check-metrics-count (what port)
  "Scrape PORT's /gallop/metrics, make 3 GETs answered 200 (/ok) and one
answered 404 (/missing), scrape again: the answers, the histogram and the
octets in and out moved by exactly those.  The first scrape's own answer
and the second scrape's request are counted between the two texts too (an
answer is counted as it begins, after its text was made)."
  (let* ((scrape (closing-get "/gallop/metrics"))
         (first-answer (metrics-exchange port scrape))
         (before (parse-metrics (exchange-body first-answer)))
         (requests (list (closing-get "/ok") (closing-get "/ok?a=1")
                         (closing-get "/ok") (closing-get "/missing")))
         (answers (loop for request in requests collect (metrics-exchange port request)))
         (second-answer (metrics-exchange port scrape)))
    (is (= 200 (exchange-status first-answer)) "~A: the metrics answer" what)
    (is (search "Content-Type: text/plain; version=0.0.4; charset=utf-8"
                (map 'string #'code-char first-answer))
        "~A: ~A" what (map 'string #'code-char (subseq first-answer 0 200)))
    (is (equal '(200 200 200 404) (mapcar #'exchange-status answers)) "~A" what)
    (multiple-value-bind (after error) (parse-metrics (exchange-body second-answer))
      (is-true before "~A: the first text did not parse" what)
      (is-true after "~A: the second text did not parse: ~A" what error)
      (when (and before after)
        (check-metric-families what after)
        (flet ((moved (key) (- (metric-value after key) (metric-value before key))))
          (is (= 4 (moved (answers-key "GET" "2xx"))) "~A: 2xx moved by ~D" what
              (moved (answers-key "GET" "2xx")))
          (is (= 1 (moved (answers-key "GET" "4xx"))) "~A: 4xx moved by ~D" what
              (moved (answers-key "GET" "4xx")))
          (is (= 0 (moved (answers-key "other" "4xx"))) "~A" what)
          (is (= 5 (moved "gallop_http_request_duration_seconds_count{}")) "~A" what)
          (is (= 5 (moved "gallop_http_request_duration_seconds_bucket{le=+Inf}")) "~A" what)
          (is (<= 0 (moved "gallop_http_request_duration_seconds_sum{}")) "~A" what)
          (let ((in (+ (loop for request in requests sum (length request)) (length scrape)))
                (out (+ (loop for answer in answers sum (length answer)) (length first-answer))))
            (is (= in (moved "gallop_received_bytes_total{}")) "~A: received ~D, sent ~D octets"
                what (moved "gallop_received_bytes_total{}") in)
            (is (= out (moved "gallop_sent_bytes_total{}")) "~A: counted ~D sent, the client read ~D"
                what (moved "gallop_sent_bytes_total{}") out))
          (is (= 5 (moved "gallop_connections_accepted_total{}")) "~A" what)
          (is (<= 1 (metric-value after "gallop_open_connections{}")) "~A" what)
          (is (<= 1 (metric-value after "gallop_pool_threads{}")) "~A" what)
          (is (<= 1 (metric-value after "gallop_pool_run_permits{}")) "~A" what)
          (is (plusp (metric-value after "gallop_head_budget_bytes{}")) "~A" what))))))

;;; The native API

(defun metrics-test-app (env)
  (let ((path (getf env :path-info)))
    (cond ((string= path "/gallop/metrics") (gallop:metrics-app env))
          ((string= path "/ok") '(200 (:content-type "text/plain") ("ok")))
          (t '(404 (:content-type "text/plain") ("not here"))))))

(test native-metrics-count-what-clients-sent
  "GALLOP:METRICS-APP mounted by an app: its text parses as Prometheus
reads it, and counts exactly the answers and octets of the requests made."
  (with-app (server #'metrics-test-app)
    (check-metrics-count "native" (native-port server))))

(test refusals-are-counted-as-method-other
  "A request the core refuses itself before its head was read (a request
line over its limit: 414) counts as method \"other\" and as its class, but
not in the duration histogram: a client would set that duration."
  (with-app (server #'metrics-test-app)
    (let* ((port (native-port server))
           (before (parse-metrics (gallop:metrics-text server)))
           (answer (metrics-exchange port (crlf (format nil "GET /~A HTTP/1.1"
                                                    (make-string (* 70 1024) :initial-element #\a))
                                            "Host: x")))
           (after (parse-metrics (gallop:metrics-text server))))
      (is (= 414 (exchange-status answer)))
      (is (= 1 (- (metric-value after (answers-key "other" "4xx"))
                  (metric-value before (answers-key "other" "4xx")))))
      (is (= 0 (- (metric-value after (answers-key "GET" "4xx"))
                  (metric-value before (answers-key "GET" "4xx")))))
      (is (= 0 (- (metric-value after "gallop_http_request_duration_seconds_count{}")
                  (metric-value before "gallop_http_request_duration_seconds_count{}"))))
      (is (= 1 (- (metric-value after "gallop_rejected_total{}")
                  (metric-value before "gallop_rejected_total{}")))))))

(test tls-handshakes-are-counted
  "Each TLS handshake the server completes is counted once."
  (with-tls-app (server #'metrics-test-app)
    (let ((before (parse-metrics (gallop:metrics-text server))))
      (dotimes (i 2)
        (let ((client (tls-connect (native-port server))))
          (unwind-protect (is (wire-response-p (tls-get client "/ok" :close t)))
            (tls-close client))))
      (let ((after (parse-metrics (gallop:metrics-text server))))
        (is (= 2 (- (metric-value after "gallop_tls_handshakes_total{}")
                    (metric-value before "gallop_tls_handshakes_total{}"))))
        (is (= 2 (- (metric-value after (answers-key "GET" "2xx"))
                    (metric-value before (answers-key "GET" "2xx")))))))))

;;; The Hunchentoot front end

(test hunchentoot-metrics-count-what-clients-sent
  "GALLOP:CREATE-METRICS-DISPATCHER on a GALLOP:EASY-ACCEPTOR: the same as
the native API's, Hunchentoot's own 404 included."
  (with-globals ((hunchentoot:*dispatch-table*
                  (list (gallop:create-metrics-dispatcher "/gallop/metrics")
                        (hunchentoot:create-regex-dispatcher "^/ok$" (lambda () "ok")))))
    (with-server (acceptor 'gallop:easy-acceptor)
      (check-metrics-count "easy-acceptor" (port-of acceptor)))))

(test metrics-handler-serves-a-stock-acceptor-with-gallop-s-taskmaster
  "GALLOP:METRICS-HANDLER on a stock Hunchentoot acceptor given
GALLOP:TASKMASTER; 503 on an acceptor Gallop does not serve."
  (with-globals ((hunchentoot:*dispatch-table*
                  (list (gallop:create-metrics-dispatcher "/gallop/metrics"))))
    (with-server (acceptor 'hunchentoot:easy-acceptor
                           :taskmaster (make-instance 'gallop:taskmaster))
      (let ((answer (metrics-exchange (port-of acceptor) (closing-get "/gallop/metrics"))))
        (is (= 200 (exchange-status answer)))
        (let ((table (parse-metrics (exchange-body answer))))
          (is-true table)
          (when table (check-metric-families "stock acceptor" table)))))
    (with-server (acceptor 'hunchentoot:easy-acceptor)
      (is (= 503 (exchange-status (metrics-exchange (port-of acceptor)
                                              (closing-get "/gallop/metrics"))))))))

;;; Durations

(defparameter *sleeps* 10
  "Requests CHECK-SLEEPS-OVER-10-MS makes.")

(defun check-sleeps-over-10-ms (what port server)
  "*SLEEPS* requests to /sleep on PORT, each answered after a sleep of 10 ms,
on a fresh SERVER: every one counted above 10 ms, none in the bucket of
0.01, the sum at least their sleeps.  (A lower bound on a sleep holds on
any machine; the coarse clock reads a 10 ms sleep as 8 ms about half the
time on a 4 ms tick.)"
  (let ((answers (loop repeat *sleeps* collect (metrics-exchange port (closing-get "/sleep")))))
    (is (every (lambda (answer) (= 200 (exchange-status answer))) answers) "~A" what))
  (multiple-value-bind (table error) (parse-metrics (gallop:metrics-text server))
    (is-true table "~A: ~A" what error)
    (when table
      (flet ((bucket (le)
               (metric-value table (format nil "gallop_http_request_duration_seconds_bucket{le=~A}"
                                           le))))
        (is (= *sleeps* (metric-value table "gallop_http_request_duration_seconds_count{}"))
            "~A" what)
        (is (= 0 (bucket "0.005") (bucket "0.01")) "~A: ~D of ~D counted at 10 ms or less"
            what (bucket "0.01") *sleeps*)
        (is (>= (metric-value table "gallop_http_request_duration_seconds_sum{}")
                (* *sleeps* 0.010d0))
            "~A: ~F s in all" what
            (metric-value table "gallop_http_request_duration_seconds_sum{}"))))))

(test native-durations-are-measured-to-the-microsecond
  (with-app (server (lambda (env)
                      (if (string= "/sleep" (getf env :path-info))
                          (progn (sleep 0.01) '(200 (:content-type "text/plain") ("slept")))
                          '(404 nil ("")))))
    (check-sleeps-over-10-ms "native" (native-port server) server)))

(test hunchentoot-durations-are-measured-to-the-microsecond
  (with-globals ((hunchentoot:*dispatch-table*
                  (list (hunchentoot:create-regex-dispatcher
                         "^/sleep$" (lambda () (sleep 0.01) "slept")))))
    (with-server (acceptor 'gallop:easy-acceptor)
      (check-sleeps-over-10-ms "easy-acceptor" (port-of acceptor) acceptor))))

;;; Without a server

(test duration-buckets-take-microseconds
  "Durations are microseconds: a bucket holds those up to its bound, so
1 ms in the first, 1.001 ms to 2.5 ms in the second, 10 ms in the bucket of
0.01 and 10.001 ms in the next; past 10 s in the last, counted only in +Inf."
  (flet ((bucket (us) (gallop.core::duration-bucket us)))
    (is (= 0 (bucket 0)))
    (is (= 0 (bucket 1000)))
    (is (= 1 (bucket 1001)))
    (is (= 1 (bucket 2500)))
    (is (= 2 (bucket 2501)))
    (is (= 2 (bucket 5000)))
    (is (= 3 (bucket 5001)))
    (is (= 3 (bucket 10000)))
    (is (= 4 (bucket 10001)))
    (is (= 12 (bucket 10000000)))
    (is (= 13 (bucket 10000001)))
    (is (= 13 (bucket most-positive-fixnum))))
  (is (equal '(0 1 2 3 4 5 6 7 7 7)
             (mapcar #'gallop.core::method-index
                     (list :get :head :post :put :delete :patch :options :connect nil
                           (make-symbol "GET")))))
  (is (equal '(0 1 2 3 4 4 4)
             (mapcar #'gallop.core::status-class '(101 204 302 404 503 99 600)))))

(test metrics-text-is-prometheus-text-format
  "WRITE-METRICS from given stats and counts: every family has its HELP and
TYPE lines, the buckets are cumulative, the sum is in seconds, and the text
parses as Prometheus reads it."
  (let* ((counts (make-array gallop.core::+counts-end+ :initial-element 0))
         (stats '(:open 3 :idle 2 :active 1 :suspended 4 :threads 5 :run-permits 2
                  :shed 6 :head-bytes 8192 :stop-cut 2))
         (text (progn
                 (setf (svref counts (+ gallop.core::+answer-cells+ (* 5 2) 4)) 7 ; POST 5xx
                       (svref counts (+ gallop.core::+bucket-cells+ 0)) 3
                       (svref counts (+ gallop.core::+bucket-cells+ 2)) 2
                       (svref counts (+ gallop.core::+bucket-cells+ 13)) 2
                       (svref counts gallop.core::+duration-us-cell+) 21234567
                       (svref counts gallop.core::+bytes-in-cell+) 100
                       (svref counts gallop.core::+bytes-out-cell+) 200
                       (svref counts gallop.core::+tls-handshakes-cell+) 9)
                 (with-output-to-string (out)
                   (gallop.core::write-metrics out stats counts :head-budget 1000
                                                                :body-budget 2000
                                                                :disk-budget 3000))))
         (lines (uiop:split-string (string-right-trim '(#\Newline) text)
                                   :separator '(#\Newline))))
    (dolist (line '("gallop_http_requests_total{method=\"POST\",code=\"5xx\"} 7"
                    "gallop_http_requests_total{method=\"other\",code=\"1xx\"} 0"
                    "gallop_http_request_duration_seconds_bucket{le=\"0.001\"} 3"
                    "gallop_http_request_duration_seconds_bucket{le=\"0.0025\"} 3"
                    "gallop_http_request_duration_seconds_bucket{le=\"0.005\"} 5"
                    "gallop_http_request_duration_seconds_bucket{le=\"10\"} 5"
                    "gallop_http_request_duration_seconds_bucket{le=\"+Inf\"} 7"
                    "gallop_http_request_duration_seconds_sum 21.234567"
                    "gallop_http_request_duration_seconds_count 7"
                    "gallop_received_bytes_total 100" "gallop_sent_bytes_total 200"
                    "gallop_tls_handshakes_total 9" "gallop_open_connections 3"
                    "gallop_shed_total 6" "gallop_pool_run_permits 2"
                    "gallop_head_budget_used_bytes 8192" "gallop_head_budget_bytes 1000"
                    "gallop_aborted_total 0" "gallop_stop_cut_total 2"))
      (is-true (member line lines :test #'string=) "no line ~S" line))
    (is (= 40 (count-if (lambda (line) (uiop:string-prefix-p "gallop_http_requests_total{" line))
                        lines)))
    ;; Each TYPE line right after the HELP line of the same name, once each.
    (loop for (help type) on lines
          when (uiop:string-prefix-p "# HELP " help)
            do (let ((name (third (uiop:split-string help :separator " "))))
                 (is-true (uiop:string-prefix-p (format nil "# TYPE ~A " name) type)
                          "~S then ~S" help type)))
    (is (= (count-if (lambda (line) (uiop:string-prefix-p "# HELP " line)) lines)
           (count-if (lambda (line) (uiop:string-prefix-p "# TYPE " line)) lines)))
    (multiple-value-bind (table error) (parse-metrics text)
      (is-true table "~A" error)
      (when table
        (check-metric-families "pure" table)
        (is (= 7 (metric-value table (answers-key "POST" "5xx"))))
        (is (= 21.234567d0 (metric-value table "gallop_http_request_duration_seconds_sum{}")))))))
