;;;; deploy.lisp -- examples/deploy/ as its README runs it: start.lisp by
;;;; hand, in a child SBCL (answers, readiness, metrics, its access log,
;;;; SIGHUP, SIGTERM), and its systemd units as systemd-analyze reads them.

(in-package #:gallop-tests)

(in-suite production)

(defun deploy-file (name)
  (merge-pathnames (concatenate 'string "examples/deploy/" name)
                   (asdf:system-source-directory "gallop")))

(defun start-deploy-example (dir)
  "examples/deploy/start.lisp run by hand as its README says (sbcl --script),
in DIR, on 127.0.0.1 and a free port (0), its access log DIR/access.log,
with no ASDF configuration in its environment: it finds Gallop itself.
Returns the process, the port once it says it serves (or NIL), and what it
said instead (its standard error's first lines when it said nothing)."
  (let* ((errors (merge-pathnames "stderr.txt" dir))
         (process (sb-ext:run-program
                   "sbcl" (list "--script" (namestring (deploy-file "start.lisp"))
                                "0" (namestring (merge-pathnames "access.log" dir)))
                   :search t :wait nil :input nil :output :stream
                   :error errors :if-error-exists :supersede
                   :directory dir
                   :environment (remove-if (lambda (variable)
                                             (uiop:string-prefix-p "CL_SOURCE_REGISTRY=" variable))
                                           (sb-ext:posix-environ))))
         (line (read-line (sb-ext:process-output process) nil ""))
         (prefix "Serving http://127.0.0.1:"))
    (if (uiop:string-prefix-p prefix line)
        (values process (parse-integer line :start (length prefix) :junk-allowed t) line)
        (values process nil
                (if (string= line "")
                    (progn (sb-ext:process-wait process)
                           (format nil "~{~A~^ / ~}"
                                   (let ((lines (ignore-errors (log-lines errors))))
                                     (subseq lines 0 (min 3 (length lines))))))
                    line)))))

(defun access-log-rests (path)
  "The lines of the access log PATH without their times (WITHOUT-TIME),
sorted, if every time had the Combined Log Format's form; else the lines."
  (let ((lines (and (probe-file path) (log-lines path))))
    (if (every (lambda (line) (nth-value 1 (without-time line))) lines)
        (sort (mapcar #'without-time lines) #'string<)
        lines)))

(test the-deploy-example-runs-by-hand-as-its-readme-says
  "examples/deploy/start.lisp, run by hand with sbcl --script and no ASDF
configuration, finds Gallop, answers / and /ready, serves its metrics
\(parsed by prometheus_client), and logs each answer in the combined format.
SIGHUP opens the access log again by its name (logrotate moved it): the
process lives on and logs to the new file.  SIGTERM stops it, status 0."
  (let ((dir (uiop:ensure-directory-pathname (merge-pathnames "deploy/" (run-directory)))))
    (ensure-directories-exist dir)
    (let ((log (merge-pathnames "access.log" dir))
          (rotated (merge-pathnames "access.log.1" dir)))
      (multiple-value-bind (process port said) (start-deploy-example dir)
        (unwind-protect
             (when (progn (is-true port "start.lisp said ~S" said) port)
               (is (exact-answer-p (strict-get port "/") "Hey!") "/")
               (is (exact-answer-p (strict-get port "/ready") "ready") "/ready")
               (let* ((answer (metrics-exchange port (closing-get "/metrics")))
                      (body (exchange-body answer)))
                 (is (= 200 (exchange-status answer)) "/metrics")
                 (multiple-value-bind (table error) (parse-metrics body)
                   (is-true table "the metrics did not parse: ~A" error)
                   (when table
                     (check-metric-families "start.lisp" table)
                     (is (= 2 (metric-value table (answers-key "GET" "2xx")))
                         "the GETs answered 2xx before the metrics: ~D"
                         (metric-value table (answers-key "GET" "2xx")))))
                 (let ((expected (sort (list "127.0.0.1 - - [T] \"GET / HTTP/1.1\" 200 4 \"-\" \"-\""
                                             "127.0.0.1 - - [T] \"GET /ready HTTP/1.1\" 200 5 \"-\" \"-\""
                                             (format nil "127.0.0.1 - - [T] \"GET /metrics HTTP/1.1\" ~
                                                          200 ~D \"-\" \"-\"" (length body)))
                                       #'string<)))
                   (is (wait-until (lambda () (= 3 (length (access-log-rests log)))))
                       "the access log: ~S" (access-log-rests log))
                   (is (equal expected (access-log-rests log)) "~S~%  expected ~S"
                       (access-log-rests log) expected)))
               ;; logrotate: move the file, then SIGHUP.
               (rename-file log rotated)
               (sb-ext:process-kill process sb-unix:sighup)
               (is-true (wait-until (lambda () (probe-file log)))
                        "no new access log after SIGHUP; the process ~:[exited with ~D~;lives~]"
                        (sb-ext:process-alive-p process) (sb-ext:process-exit-code process))
               (when (sb-ext:process-alive-p process)
                 (is (exact-answer-p (strict-get port "/?after-sighup") "Hey!") "after SIGHUP")
                 (is (wait-until (lambda () (access-log-rests log)))
                     "the new access log stays empty")
                 (is (equal '("127.0.0.1 - - [T] \"GET /?after-sighup HTTP/1.1\" 200 4 \"-\" \"-\"")
                            (access-log-rests log)))
                 (is (= 3 (length (access-log-rests rotated))) "~S" (access-log-rests rotated))
                 (sb-ext:process-kill process sb-unix:sigterm)
                 (is-true (wait-until (lambda () (not (sb-ext:process-alive-p process)))
                                      :timeout 60)
                          "still running 60 s after SIGTERM")
                 (is (eql 0 (sb-ext:process-exit-code process)) "exit status ~S after SIGTERM"
                     (sb-ext:process-exit-code process))))
          (when (sb-ext:process-alive-p process)
            (sb-ext:process-kill process 9)
            (sb-ext:process-wait process))
          (sb-ext:process-close process))))))

(test systemd-analyze-verifies-the-deploy-units
  "systemd-analyze verify accepts gallop@.service and gallop@.socket, as the
instances gallop@8080.service and gallop@8080.socket, without a warning."
  (if (not (probe-file "/usr/bin/systemd-analyze"))
      (skip "systemd-analyze is not installed (Debian's systemd): the units are not verified.")
      (multiple-value-bind (output error status)
          (uiop:run-program (list "/usr/bin/systemd-analyze" "verify"
                                  (namestring (deploy-file "gallop@8080.service"))
                                  (namestring (deploy-file "gallop@8080.socket")))
                            :output :string :error-output :string :ignore-error-status t)
        (is (eql 0 status) "status ~S: ~A~A" status output error)
        (is (string= "" (concatenate 'string output error)) "~A~A" output error))))
