;;;; handler.lisp -- the Clack handler, called the way Clack calls it:
;;;; (apply #'clack.handler.gallop:run app :allow-other-keys t options) in a
;;;; thread, stopped by destroying that thread.

(in-package #:gallop-tests)

(in-suite native)

(defun clack-run ()
  "CLACK.HANDLER.GALLOP:RUN, loading the handler first (under the name older
Clack asks ASDF for).  Its one dependency beyond Gallop, Clack's socket
protocol (system clack-socket, a package of generic functions), is found
by ASDF: every test that calls this is within WITH-OPTIONAL-SYSTEMS."
  (asdf:load-system "clack-handler-gallop")
  (find-symbol "RUN" "CLACK.HANDLER.GALLOP"))

(defun port-open-p (port)
  "True when something accepts connections on PORT (Clack's own readiness test)."
  (handler-case (progn (usocket:socket-close (usocket:socket-connect "127.0.0.1" port)) t)
    (error () nil)))

(defun call-like-clack (app port &rest options)
  "Start the handler the way clackup with :use-thread t does: in a new thread,
with :port, :debug, :use-thread, the rest of the user's clackup options and
:allow-other-keys t.  Returns the thread once PORT accepts connections."
  (let* ((run (clack-run))
         (thread (sb-thread:make-thread
                  (lambda ()
                    (apply run app :allow-other-keys t
                                   :port port :debug nil :use-thread t
                                   options))
                  :name "clack-handler")))
    (unless (wait-until (lambda () (port-open-p port)))
      (sb-thread:terminate-thread thread)
      (error "The Clack handler did not start on port ~D." port))
    thread))

(defun stop-like-clack (thread)
  "Clack's STOP: destroy the handler thread (and wait for it)."
  (sb-thread:terminate-thread thread)
  (sb-thread:join-thread thread :default nil))

(defmacro with-clack-handler ((port app &rest options) &body body)
  "Run BODY with APP served by the Clack handler on PORT, a free port (FREE-PORT
is in core/emfile.lisp), called
with OPTIONS as Clack calls it; always stop it as Clack does.  Skips the
test when ASDF cannot find Clack's socket protocol."
  (let ((thread (gensym "THREAD")))
    `(with-optional-systems ("clack-socket")
       (let* ((,port (free-port))
              (,thread (call-like-clack ,app ,port ,@options)))
         (unwind-protect (progn ,@body)
           (stop-like-clack ,thread))))))

(defun whole-answer (port request)
  "Send REQUEST on a new connection and read everything the server sends until
it closes.  Returns the status line, the header lines as (name . value)
pairs, and the body: the octets after the blank line."
  (let ((socket (connect port)))
    (unwind-protect
         (let* ((octets (progn (send socket request)
                               (read-to-eof (usocket:socket-stream socket))))
                (text (map 'string #'code-char octets))
                (crlf (coerce '(#\Return #\Linefeed) 'string))
                (end (search (concatenate 'string crlf crlf) text))
                (lines (and end (uiop:split-string (subseq text 0 end) :separator '(#\Linefeed)))))
           (values (and lines (string-right-trim '(#\Return) (first lines)))
                   (loop for line in (rest lines)
                         for colon = (position #\: line)
                         collect (cons (subseq line 0 colon)
                                       (string-trim '(#\Space #\Return) (subseq line (1+ colon)))))
                   (and end (subseq octets (+ end 4)))))
      (usocket:socket-close socket))))

(defun is-error-answer (port request status-line)
  "REQUEST is answered with STATUS-LINE and a whole, well-formed error answer:
Content-Type, Content-Length equal to the body's length, Connection: close,
then the connection closes with nothing after the body."
  (multiple-value-bind (line headers body) (whole-answer port request)
    (is (equal status-line line))
    (is (equal '("Connection" "Content-Length" "Content-Type")
               (sort (mapcar #'car headers) #'string<))
        "headers of ~A: ~S" status-line headers)
    (is (equal "close" (cdr (assoc "Connection" headers :test #'string=))))
    (is (uiop:string-prefix-p "text/plain" (cdr (assoc "Content-Type" headers :test #'string=))))
    (is (equal (princ-to-string (length body))
               (cdr (assoc "Content-Length" headers :test #'string=))))
    (is (plusp (length body)))))

(test clack-handler-runs-and-stops-as-clack-does
  (let* ((threads (sb-thread:list-all-threads))
         (app (lambda (env)
                (list 200 '(:content-type "text/plain")
                      (list (format nil "clack ~A" (getf env :path-info))))))
         (port nil))
    (with-clack-handler (p app :address "127.0.0.1" :use-default-middlewares nil)
      (setf port p)
      (let ((r (get-request port "/hello")))
        (is (= 200 (response-status r)))
        (is (string= "clack /hello" (body-string r)))))
    (when port                          ; not skipped
      (is (no-threads-left-p threads) "threads left: ~S" (threads-started-since threads))
      ;; the port is free again
      (let ((s (usocket:socket-listen "127.0.0.1" port :reuse-address t)))
        (is (= port (usocket:get-local-port s)))
        (usocket:socket-close s)))))

(test clack-handler-loads-under-both-system-names
  ;; Older Clack loads clack-handler-gallop; Clack (Lack) since 2025 asks
  ;; ASDF for clack.handler.gallop.  Each name alone, in a fresh SBCL with
  ;; this checkout on ASDF's central registry and the same source registry
  ;; as this one (for Clack's socket protocol), gives the handler.
  (with-optional-systems ("clack-socket")
   (dolist (name '("clack-handler-gallop" "clack.handler.gallop"))
    (multiple-value-bind (output error-output status)
        (uiop:run-program
         (list "scripts/lisp.sh"
               "--eval" (format nil "(asdf:load-system ~S)" name)
               "--eval" "(format t \"~&RUN=~A~%\" (and (fboundp (find-symbol \"RUN\" \"CLACK.HANDLER.GALLOP\")) t))")
         :directory (asdf:system-source-directory "gallop")
         :output :string :error-output :string :ignore-error-status t)
      (is (eql 0 status) "loading ~A failed: ~A" name error-output)
      (is (search (format nil "~%RUN=T~%") (format nil "~%~A" output))
          "~A did not define CLACK.HANDLER.GALLOP:RUN: ~A" name output)))))

(test start-keywords-are-starts-lambda-list
  "GALLOP::+START-KEYWORDS+, what the Clack handler passes on from clackup,
is exactly the keywords of GALLOP:START's lambda list, in order."
  (let ((keywords (loop for parameter in (rest (member '&key (sb-introspect:function-lambda-list
                                                               #'gallop:start)))
                        until (member parameter lambda-list-keywords)
                        collect (let ((name (if (consp parameter) (first parameter) parameter)))
                                  ;; NAME is VAR or (KEYWORD VAR).
                                  (if (consp name)
                                      (first name)
                                      (intern (symbol-name name) :keyword))))))
    (is (member :port keywords) "START's lambda list is unreadable: ~S" keywords)
    (is (equal keywords gallop::+start-keywords+)
        "START: ~S~%list: ~S" keywords gallop::+start-keywords+)))

(test clack-handler-passes-every-start-option
  ;; The limits reach GALLOP:START.  With :max-head-bytes 10000 a head of
  ;; 12,000 bytes (under the default) gets 431; with :max-request-line-bytes
  ;; 1024 a request line of 9,000 bytes (under START's default, and in a head
  ;; under 10,000 bytes) gets 414.  Both are over the 8 KiB the server reads
  ;; at once, so the answer does not depend on how the engine splits reads.
  ;; Clack's own options, and an option of another server (woo's
  ;; :worker-num), are ignored.
  (let ((app (lambda (env)
               (list 200 '(:content-type "text/plain")
                     (list (format nil "ok ~D" (length (gethash "x-filler" (getf env :headers) ""))))))))
    (with-clack-handler (port app :address "127.0.0.1" :use-default-middlewares nil
                                  :max-head-bytes 10000 :max-request-line-bytes 1024
                                  :worker-num 4)
      ;; (Connection: close, so that a wrong 200 ends the answer too.)
      (is-error-answer port (crlf "GET / HTTP/1.1" "Host: 127.0.0.1" "Connection: close"
                                  (format nil "X-Filler: ~A" (make-string 12000 :initial-element #\f)))
                       "HTTP/1.1 431 Request Header Fields Too Large")
      (is-error-answer port (crlf (format nil "GET /~A HTTP/1.1" (make-string 9000 :initial-element #\p))
                                  "Host: 127.0.0.1" "Connection: close")
                       "HTTP/1.1 414 URI Too Long")
      ;; Under both limits: served.
      (let ((r (get-request port "/" (format nil "X-Filler: ~A" (make-string 1000 :initial-element #\f)))))
        (is (= 200 (response-status r)))
        (is (equal "7" (header r "Content-Length")))
        (is (string= "ok 1000" (body-string r)))))))

(test clack-handler-default-limits-take-a-96000-byte-header
  ;; With no limit given, a 96,000-byte header value is within the default
  ;; :max-head-bytes (1 MiB, as Go's; issue 13) and reaches the app whole.
  (let ((value (let ((s (make-string 96000)))
                 (dotimes (i 96000 s)
                   (setf (char s i) (code-char (+ 97 (mod (* i 7) 26))))))))
    (with-clack-handler (port (lambda (env)
                                (list 200 '(:content-type "text/plain")
                                      (list (gethash "x-big" (getf env :headers) "missing"))))
                              :address "127.0.0.1" :use-default-middlewares nil)
      (let ((r (get-request port "/big" (format nil "X-Big: ~A" value))))
        (is (= 200 (response-status r)))
        (is (equal "96000" (header r "Content-Length")))
        ;; (a failure must not print 96,000 characters)
        (is (string= value (body-string r))
            "the body is not the header's value (~D bytes)" (length (response-body r)))))))

(test clack-handler-serves-https-with-clacks-tls-options
  ;; clackup's :ssl-cert-file and :ssl-key-file (as woo and Hunchentoot's
  ;; Clack handlers take them) make GALLOP:START serve HTTPS.
  (destructuring-bind (cert key) (test-certificate)
    (let ((app (lambda (env)
                 (list 200 '(:content-type "text/plain")
                       (list (format nil "clack ~A" (getf env :url-scheme)))))))
      (with-clack-handler (port app :address "127.0.0.1" :use-default-middlewares nil
                                    :ssl-cert-file (namestring cert) :ssl-key-file (namestring key))
        (let ((client (tls-connect port)))
          (unwind-protect
               (check-exact-tls-answer "clackup over TLS" (tls-get client "/" :close t)
                                       "clack https")
            (tls-close client)))))))
