;;;; access-log.lisp -- the native API's access log (GALLOP:START's
;;;; :ACCESS-LOG): the Combined Log Format byte for byte, nginx's escaping
;;;; of what a client sent, JSON lines a JSON parser reads, and a file opened
;;;; again by its name for logrotate.

(in-package #:gallop-tests)

(in-suite production)

(defun logged-app (env)
  (if (string= (getf env :path-info) "/stream")
      (lambda (responder)
        (let ((writer (funcall responder '(200 (:content-type "text/plain")))))
          (funcall writer "Hey" :close nil)
          (funcall writer "!" :close t)))
      '(200 (:content-type "text/plain") ("Hey!"))))

(defun exchange-raw (port request &key head)
  "Send REQUEST (a string of octets as characters) on a fresh connection to
PORT and read the answer strictly; the connection then closes."
  (let ((socket (connect port)))
    (unwind-protect
         (let ((stream (usocket:socket-stream socket)))
           (write-sequence (map '(vector (unsigned-byte 8)) #'char-code request) stream)
           (force-output stream)
           (read-wire-or-error socket :close t :head-request head))
      (usocket:socket-close socket))))

(defun log-lines (path)
  "The lines of the file PATH, read as Latin-1."
  (with-open-file (in path :external-format :latin-1)
    (loop for line = (read-line in nil) while line collect line)))

(defun without-time (line)
  "LINE with its [time] replaced by [T], and whether that time had CLF's form."
  (let* ((open (position #\[ line))
         (close (and open (position #\] line :start open))))
    (if close
        (values (concatenate 'string (subseq line 0 open) "[T]" (subseq line (1+ close)))
                (cl-ppcre:scan "^\\d\\d/[A-Z][a-z]{2}/\\d{4}:\\d\\d:\\d\\d:\\d\\d \\+0000$"
                               (subseq line (1+ open) close)))
        (values line nil))))

(test the-access-log-writes-the-combined-log-format
  "One line per answer in nginx's combined format: what the client sent
that could break or forge a line (a quote, a backslash, a byte above 127)
is escaped as nginx escapes it (\\xHH); an absent Referer or User-Agent is
\"-\"; a HEAD answer sent 0 octets of body, a streamed one an unknown number."
  (let* ((path (merge-pathnames "access.log" (run-directory)))
         (server (progn (when (probe-file path) (delete-file path))
                        (gallop:start #'logged-app :address "127.0.0.1" :port 0 :log nil
                                                   :access-log path)))
         (port (gallop:server-port server)))
    (unwind-protect
         (progn
           (is (exact-answer-p
                (exchange-raw port (format nil "GET /yo?x=1 HTTP/1.1~C~CHost: x~C~CUser-Agent: ua \"q\" \\ ~C~C~CReferer: http://ref/~C~CConnection: close~C~C~C~C"
                                           #\Return #\Linefeed #\Return #\Linefeed
                                           (code-char #xE9) #\Return #\Linefeed
                                           #\Return #\Linefeed #\Return #\Linefeed
                                           #\Return #\Linefeed))
                "Hey!"))
           (exchange-raw port (crlf "HEAD /yo HTTP/1.1" "Host: x" "Connection: close") :head t)
           (exchange-raw port (crlf "GET /stream HTTP/1.1" "Host: x" "Connection: close")))
      (gallop:stop server))
    ;; GALLOP:STOP wrote what was queued.  Lines of one pass of the
    ;; writer come grouped by the worker that made them: sorted here.
    (let ((lines (sort (log-lines path) #'string< :key #'without-time)))
      (is (= 3 (length lines)) "~S" lines)
      (let ((expected (sort (list (format nil "127.0.0.1 - - [T] \"GET /yo?x=1 HTTP/1.1\" 200 4 \"http://ref/\" \"ua \\x22q\\x22 \\x5C \\xE9\"")
                                  "127.0.0.1 - - [T] \"HEAD /yo HTTP/1.1\" 200 0 \"-\" \"-\""
                                  "127.0.0.1 - - [T] \"GET /stream HTTP/1.1\" 200 - \"-\" \"-\"")
                            #'string<)))
        (loop for line in lines
              for want in expected
              do (multiple-value-bind (rest time-ok) (without-time line)
                   (is (string= want rest) "~S~%  expected ~S" line want)
                   (is-true time-ok "the time of ~S" line)))))))

(test the-access-log-writes-json-lines-a-parser-reads
  "With :ACCESS-LOG-FORMAT :JSON each line is one JSON object, whatever the
client sent (here a quote, a backslash and a byte above 127): Python's json
module reads it back to the same values."
  (let* ((path (merge-pathnames "access.json" (run-directory)))
         (server (progn (when (probe-file path) (delete-file path))
                        (gallop:start #'logged-app :address "127.0.0.1" :port 0 :log nil
                                                   :access-log path :access-log-format :json)))
         (port (gallop:server-port server)))
    (unwind-protect
         (exchange-raw port (format nil "GET /yo HTTP/1.1~C~CHost: x~C~CUser-Agent: a\"b\\c~C~C~CConnection: close~C~C~C~C"
                                    #\Return #\Linefeed #\Return #\Linefeed (code-char #xE9)
                                    #\Return #\Linefeed #\Return #\Linefeed #\Return #\Linefeed))
      (gallop:stop server))
    (let ((output (uiop:run-program
                   (list "/usr/bin/python3" "-c"
                         "import json,sys
for line in open(sys.argv[1], encoding='ascii'):
    o = json.loads(line)
    del o['time']
    print(sorted(o.items()))"
                         (namestring path))
                   :output :string :error-output :string :ignore-error-status t)))
      (is (string= (format nil "[('bytes', 4), ('method', 'GET'), ('protocol', 'HTTP/1.1'), ~
                                ('referer', ''), ('remote_addr', '127.0.0.1'), ('remote_user', ''), ~
                                ('status', 200), ('uri', '/yo'), ('user_agent', 'a\"b\\\\c~C')]~%"
                           (code-char #xE9))
                   output)
          "~A" output))))

(test the-access-log-file-is-opened-again-by-its-name
  "After logrotate moves the file, GALLOP:REOPEN-ACCESS-LOGS makes the log
write to a new file of the same name: the line before goes to the moved
file, the line after to the new one."
  (let* ((path (merge-pathnames "rotated.log" (run-directory)))
         (moved (merge-pathnames "rotated.log.1" (run-directory)))
         (server (progn (dolist (p (list path moved)) (when (probe-file p) (delete-file p)))
                        (gallop:start #'logged-app :address "127.0.0.1" :port 0 :log nil
                                                   :access-log path)))
         (port (gallop:server-port server)))
    (unwind-protect
         (progn
           (exchange-raw port (crlf "GET /before HTTP/1.1" "Host: x" "Connection: close"))
           ;; The line was written (the writer's pass is 100 ms).
           (is (wait-until (lambda () (and (probe-file path) (log-lines path))) :timeout 10))
           (rename-file path moved)
           (gallop:reopen-access-logs)
           (is (wait-until (lambda () (probe-file path)) :timeout 10) "no new file")
           (exchange-raw port (crlf "GET /after HTTP/1.1" "Host: x" "Connection: close")))
      (gallop:stop server))
    (is (equal '("127.0.0.1 - - [T] \"GET /before HTTP/1.1\" 200 4 \"-\" \"-\"")
               (mapcar #'without-time (log-lines moved))))
    (is (equal '("127.0.0.1 - - [T] \"GET /after HTTP/1.1\" 200 4 \"-\" \"-\"")
               (mapcar #'without-time (log-lines path))))))

(test the-hunchentoot-front-end-keeps-hunchentoots-access-log
  "GALLOP:EASY-ACCEPTOR with :ACCESS-LOG-FORMAT :HUNCHENTOOT writes
Hunchentoot's own access log lines, as a stock HUNCHENTOOT:EASY-ACCEPTOR
given the same requests writes them, byte for byte but the time."
  (flet ((lines-of (class name)
           (let ((path (merge-pathnames name (run-directory))))
             (when (probe-file path) (delete-file path))
             (let ((server (apply #'make-instance class :address "127.0.0.1" :port 0
                                  :access-log-destination path
                                  :message-log-destination nil
                                  (and (eq class 'gallop:easy-acceptor)
                                       '(:access-log-format :hunchentoot)))))
               (hunchentoot:start server)
               (unwind-protect
                    (let ((port (port-of server)))
                      (exchange-raw port (crlf "GET /yo?name=x HTTP/1.1" "Host: x"
                                               "User-Agent: ua" "Referer: http://ref/"
                                               "Connection: close"))
                      (exchange-raw port (crlf "GET /no-such-page HTTP/1.1" "Host: x"
                                               "Connection: close")))
                 (hunchentoot:stop server)))
             (mapcar #'without-time (log-lines path)))))
    (let ((stock (lines-of 'hunchentoot:easy-acceptor "stock-access.log"))
          (gallop (lines-of 'gallop:easy-acceptor "gallop-access.log")))
      (is (= 2 (length stock)) "~S" stock)
      (is (equal stock gallop) "stock ~S~%gallop ~S" stock gallop))))

(test the-access-log-loses-no-line-of-many-workers
  "200 answers made at once by four clients on keep-alive connections (so
by several workers, each with its own buffer), and one with a User-Agent
of 3,000 characters (a line too long for a worker's scratch): every line
is in the file once, whole."
  (let* ((path (merge-pathnames "many.log" (run-directory)))
         (server (progn (when (probe-file path) (delete-file path))
                        (gallop:start #'logged-app :address "127.0.0.1" :port 0 :log nil
                                                   :access-log path)))
         (port (gallop:server-port server))
         (long (make-string 3000 :initial-element #\u)))
    (unwind-protect
         (progn
           (mapc #'sb-thread:join-thread
                 (loop for k below 4
                       collect (let ((k k))
                                 (sb-thread:make-thread
                                  (lambda ()
                                    (let ((socket (connect port)))
                                      (unwind-protect
                                           (dotimes (i 50)
                                             (send socket (crlf (format nil "GET /n-~D-~D HTTP/1.1" k i)
                                                                "Host: x"))
                                             (read-wire-or-error socket))
                                        (usocket:socket-close socket))))))))
           (exchange-raw port (crlf "GET /long HTTP/1.1" "Host: x"
                                    (format nil "User-Agent: ~A" long) "Connection: close")))
      (gallop:stop server))
    (let ((lines (mapcar #'without-time (log-lines path))))
      (is (= 201 (length lines)) "~D lines" (length lines))
      (is (equal (sort (loop for k below 4
                             append (loop for i below 50
                                          collect (format nil "127.0.0.1 - - [T] \"GET /n-~D-~D HTTP/1.1\" 200 4 \"-\" \"-\"" k i)))
                       #'string<)
                 (sort (remove-if-not (lambda (line) (search "/n-" line)) lines) #'string<)))
      (is (member (format nil "127.0.0.1 - - [T] \"GET /long HTTP/1.1\" 200 4 \"-\" \"~A\"" long)
                  lines :test #'string=)))))

;;; The same lines on both front ends, what nginx writes, and every answer
;;; of the engine's own.

(defun utf-8 (string)
  "STRING's UTF-8 octets, one character each (as a request carries them)."
  (map 'string #'code-char (sb-ext:string-to-octets string :external-format :utf-8)))

(defun hey-app (env)
  "200 \"Hey!\" to every request, after reading its body; /log-sleep first
sleeps 5 s (past a handler timeout), /wire-block waits as answers.lisp's
does."
  (let ((path (getf env :path-info)))
    (cond ((string= path "/log-sleep") (sleep 5))
          ((string= path "/wire-block") (wire-block))))
  (count-stream-octets (getf env :raw-body))
  '(200 (:content-type "text/plain") ("Hey!")))

(defclass hey-acceptor (gallop:acceptor) ()
  (:documentation "A GALLOP:ACCEPTOR answering as HEY-APP does."))

(defmethod hunchentoot:acceptor-dispatch-request ((acceptor hey-acceptor) request)
  (let ((path (hunchentoot:script-name request)))
    (cond ((string= path "/log-sleep") (sleep 5))
          ((string= path "/wire-block") (wire-block))))
  (hunchentoot:raw-post-data :force-binary t)
  (setf (hunchentoot:content-type*) "text/plain")
  "Hey!")

(defun call-with-logged-front-end (kind path options function &key (format :combined))
  "Start front end KIND, :NATIVE (HEY-APP) or :ACCEPTOR (HEY-ACCEPTOR), its
access log going to PATH (emptied first) in FORMAT (:COMBINED; for
:NATIVE :JSON, for :ACCEPTOR :HUNCHENTOOT), with OPTIONS (settings); call
FUNCTION with its port and the server; stop it (which writes a native log's
last lines)."
  (when (probe-file path) (delete-file path))
  (ecase kind
    (:native
     (let ((server (apply #'gallop:start #'hey-app :address "127.0.0.1" :port 0
                          :log (message-log-destination)
                          :access-log path :access-log-format format options)))
       (unwind-protect (funcall function (gallop:server-port server) server)
         (gallop:stop server))))
    (:acceptor
     (let ((server (make-server 'hey-acceptor :access-log-destination path
                                              :access-log-format format
                                              :taskmaster (apply #'make-instance 'gallop:taskmaster
                                                                 options))))
       (hunchentoot:start server)
       (unwind-protect (funcall function (port-of server) server)
         (when (hunchentoot:started-p server)
           (hunchentoot:stop server)))))))

(defun sorted-lines (path)
  "PATH's lines, their time replaced (WITHOUT-TIME), sorted: lines of one
pass of the native log's writer come grouped by worker."
  (sort (mapcar #'without-time (log-lines path)) #'string<))

(defparameter *basic-users*
  '(("Basic YWxpY2U6cHc=" . "alice")                  ; alice:pw
    ("basic   YSJsXGkgY2U6cHc=" . "a\\x22l\\x5Ci ce")  ; a"l\i ce:pw
    ("Basic w7xuw686cHc=" . "\\xC3\\xBCn\\xC3\\xAF")    ; ünï:pw in UTF-8
    ("Basic OnB3" . "-")                              ; :pw
    ("Basic bm9jb2xvbg==" . "-")                      ; nocolon
    ("Basic !!!!" . "-")
    ("Bearer abc" . "-")
    ("Basic Ym9iOng==garbage!" . "bob")               ; bob:x, then past its "="
    ("Basic YQ" . "-")                                ; a
    ("Basic YWI6Yw" . "ab")                           ; ab:c, unpadded
    ("Basic YWI6Y" . "-")                             ; 4n+1 characters
    ("Basic" . "-"))
  "Authorization values and the $remote_user Debian's nginx (1.22) logs for
each, checked beside it by the-combined-log-matches-nginx-byte-for-byte.")

(defun header-requests ()
  "The requests of the combined-log tests, each a string of octets, with
the path that names it: empty and absent User-Agent and Referer, a forged
User-Agent, and a Basic user per *BASIC-USERS* entry."
  (append
   (list (crlf "GET /empty HTTP/1.1" "Host: x" "User-Agent: " "Referer: " "Connection: close")
         (crlf "GET /absent HTTP/1.1" "Host: x" "Connection: close")
         (crlf "GET /forged HTTP/1.1" "Host: x" "User-Agent: ua\" 200 1 \"-\" \"forged"
               "Connection: close")
         (crlf "HEAD /head HTTP/1.1" "Host: x" "User-Agent: é\\" "Connection: close"))
   (loop for (value) in *basic-users*
         for i from 0
         collect (crlf (format nil "GET /u~D HTTP/1.1" i) "Host: x"
                       (format nil "Authorization: ~A" value) "Connection: close"))))

(defun expected-header-lines ()
  "The lines (time left out) nginx's combined format makes of HEADER-REQUESTS."
  (sort (append
         (list "127.0.0.1 - - [T] \"GET /empty HTTP/1.1\" 200 4 \"\" \"\""
               "127.0.0.1 - - [T] \"GET /absent HTTP/1.1\" 200 4 \"-\" \"-\""
               "127.0.0.1 - - [T] \"GET /forged HTTP/1.1\" 200 4 \"-\" \"ua\\x22 200 1 \\x22-\\x22 \\x22forged\""
               "127.0.0.1 - - [T] \"HEAD /head HTTP/1.1\" 200 0 \"-\" \"\\xC3\\xA9\\x5C\"")
         (loop for (nil . user) in *basic-users*
               for i from 0
               collect (format nil "127.0.0.1 - ~A [T] \"GET /u~D HTTP/1.1\" 200 4 \"-\" \"-\""
                               user i)))
        #'string<))

(defun send-header-requests (port)
  (dolist (request (header-requests))
    (exchange-raw port (utf-8 request) :head (search "HEAD " request))))

(defun check-combined-header-lines (kind)
  (let ((path (merge-pathnames (format nil "headers-~(~A~).log" kind) (run-directory))))
    (call-with-logged-front-end kind path '()
                                (lambda (port server)
                                  (declare (ignore server))
                                  (send-header-requests port)))
    (let ((lines (sorted-lines path))
          (expected (expected-header-lines)))
      (is (= (length expected) (length lines)) "~(~A~): ~S" kind lines)
      (loop for line in lines
            for want in expected
            do (is (string= want line) "~(~A~): ~S~%  expected ~S" kind line want)))))

(test the-combined-log-writes-headers-and-users-as-nginx-native
  "GALLOP:START's combined log, byte for byte as Debian's nginx writes the
same requests (below, the-combined-log-matches-nginx-byte-for-byte): a
present but empty User-Agent or Referer is \"\", an absent one \"-\"; the
Basic authentication's user name (decoded as nginx decodes it, escaped as
any field) is $remote_user; a quote cannot forge a field."
  (check-combined-header-lines :native))

(test the-combined-log-writes-headers-and-users-as-nginx-acceptor
  "The same requests to a GALLOP:ACCEPTOR, whose access log is nginx's
combined format by default: the same lines."
  (check-combined-header-lines :acceptor))

(test gallop-acceptors-can-keep-hunchentoots-unescaped-lines
  "With :ACCESS-LOG-FORMAT :HUNCHENTOOT a GALLOP:ACCEPTOR writes
Hunchentoot's own line, where a quote in the User-Agent forges fields (what
:COMBINED, the default, escapes)."
  (let ((path (merge-pathnames "forged-hunchentoot.log" (run-directory))))
    (call-with-logged-front-end
     :acceptor path '()
     (lambda (port server)
       (declare (ignore server))
       (exchange-raw port (crlf "GET /forged HTTP/1.1" "Host: x"
                                "User-Agent: ua\" 200 1 \"-\" \"forged" "Connection: close")))
     :format :hunchentoot)
    (let ((lines (log-lines path)))
      (is (= 1 (length lines)) "~S" lines)
      (is (cl-ppcre:scan "^127\\.0\\.0\\.1 - \\[\\d{4}-\\d\\d-\\d\\d \\d\\d:\\d\\d:\\d\\d\\] \"GET /forged HTTP/1\\.1\" 200 4 \"-\" \"ua\" 200 1 \"-\" \"forged\"$"
                         (first lines))
          "~S" lines))))

;;; nginx beside Gallop

(defun nginx-path ()
  "Debian's nginx, or NIL."
  (find-if #'probe-file '("/usr/sbin/nginx" "/usr/bin/nginx")))

(defun call-with-nginx-access-log (function)
  "Run Debian's nginx (as tests/conformance/nginx.lisp does) on a free port
with its combined access log, every request answered 200 \"Hey!\"; call
FUNCTION with the port, stop nginx, and return the log's lines."
  (let* ((dir (format nil "/tmp/gallop-access-log-nginx-~D/" (sb-posix:getpid)))
         (port (free-port))
         (log (format nil "~Aaccess.log" dir))
         (process nil))
    (ensure-directories-exist dir)
    (with-open-file (out (format nil "~Anginx.conf" dir) :direction :output :if-exists :supersede)
      (format out "worker_processes 1;
pid ~Anginx.pid;
error_log ~Aerror.log;
events { worker_connections 64; }
http {
    client_body_temp_path ~Abody;
    proxy_temp_path ~Aproxy;
    fastcgi_temp_path ~Afastcgi;
    uwsgi_temp_path ~Auwsgi;
    scgi_temp_path ~Ascgi;
    access_log ~A combined;
    server {
        listen 127.0.0.1:~D;
        location / { return 200 \"Hey!\"; }
    }
}
" dir dir dir dir dir dir dir log port))
    (unwind-protect
         (progn
           (setf process (sb-ext:run-program (nginx-path)
                                             (list "-p" dir "-e" (format nil "~Aerror.log" dir)
                                                   "-c" (format nil "~Anginx.conf" dir)
                                                   "-g" "daemon off;")
                                             :wait nil :input nil :output nil :error nil))
           (is (wait-until (lambda ()
                             (ignore-errors (usocket:socket-close (connect port :timeout 1)) t)))
               "nginx did not start (see ~Aerror.log)" dir)
           (funcall function port))
      (when process
        (when (sb-ext:process-alive-p process)
          (sb-ext:process-kill process 15)
          (sb-ext:process-wait process))
        (sb-ext:process-close process)))
    (prog1 (and (probe-file log) (sorted-lines log))
      (uiop:delete-directory-tree (pathname dir) :validate t :if-does-not-exist :ignore))))

(defun without-bytes (line)
  "LINE with the bytes after its status replaced by B: an error's body
differs between servers."
  (cl-ppcre:regex-replace "(\" \\d{3}) \\d+ \"" line "\\1 B \""))

(test the-combined-log-matches-nginx-byte-for-byte
  "Debian's nginx and both of Gallop's front ends, given the same requests
(HEADER-REQUESTS, and refusals the three answer with the same status: a
header line without a colon, a request line that is not one, HTTP/2.0 on
an HTTP/1.1 line), write the same combined lines, but the time (and the
bytes of a refusal's body, each server's own page).  Skipped without
nginx (make test installs nginx-light)."
  (if (not (nginx-path))
      (skip "No nginx: scripts/deps.sh nginx-light installs it.")
      (let* ((refusals (list (crlf "GET /\"q\" HTTP/1.1" "Host: x" "Bad Header")
                             (crlf "garbage")
                             (crlf "GET /v HTTP/2.0" "Host: x")))
             (send (lambda (port)
                     (send-header-requests port)
                     (dolist (request refusals)
                       (exchange-raw port request))))
             (nginx (mapcar #'without-bytes (call-with-nginx-access-log send))))
        (is (= (+ (length (header-requests)) (length refusals)) (length nginx)) "nginx: ~S" nginx)
        (dolist (kind '(:native :acceptor))
          (let ((path (merge-pathnames (format nil "beside-nginx-~(~A~).log" kind) (run-directory))))
            (call-with-logged-front-end kind path '()
                                        (lambda (port server)
                                          (declare (ignore server))
                                          (funcall send port)))
            (let ((gallop (mapcar #'without-bytes (sorted-lines path))))
              (is (equal nginx gallop) "~(~A~):~%~{  ~A~%~}nginx:~%~{  ~A~%~}"
                  kind gallop nginx)))))))

;;; JSON lines read the request as UTF-8

(defun json-time-free (line)
  "LINE (a JSON access-log line) with its time replaced by T."
  (cl-ppcre:regex-replace "^\\{\"time\":\"[^\"]*\"" line "{\"time\":\"T\""))

(test json-access-log-lines-read-the-request-as-utf-8
  "A JSON line carries what the client sent as UTF-8: a valid sequence as
it is (JSON text is UTF-8: é, ünï, an emoji), `\"` and `\\` escaped, and
each octet that begins no valid sequence (a lone é in Latin-1, an overlong
form, a surrogate, a cut sequence, past U+10FFFF), and each control
character, as \\u00HH.  Byte for byte, and Python's json module reads each
line back (the file read as strict UTF-8) to those values; a refused
request's line goes in \"request\"."
  (let* ((path (merge-pathnames "utf-8.json" (run-directory)))
         (agent (utf-8 "ünï é 😀 \"q\" \\"))
         (invalid (format nil "a~Cb ~C~C ~C~C~C ~C ~C~C ~C~C ~C~C~C~C z"
                          (code-char #xE9) (code-char #xC0) (code-char #xAF)
                          (code-char #xED) (code-char #xA0) (code-char #x80)
                          (code-char #x80) (code-char #xE2) (code-char #x82)
                          (code-char #xF5) (code-char #x80)
                          (code-char #xF4) (code-char #x90) (code-char #x80) (code-char #x80)))
         (refused (format nil "GET /~A~C~C HTTP/1.1" (utf-8 "ünï") (code-char 1) (code-char 127))))
    (call-with-logged-front-end
     :native path '()
     (lambda (port server)
       (declare (ignore server))
       (exchange-raw port (crlf "GET /valid HTTP/1.1" "Host: x" (format nil "User-Agent: ~A" agent)
                                (format nil "Referer: ~A" (utf-8 "/ß")) "Connection: close"))
       (exchange-raw port (crlf "GET /invalid HTTP/1.1" "Host: x"
                                (format nil "User-Agent: ~A" invalid) "Connection: close"))
       (exchange-raw port (crlf refused "Host: x")))
     :format :json)
    (let ((lines (sort (mapcar #'json-time-free (log-lines path)) #'string<))
          (expected
            (sort (list
                   (format nil "{\"time\":\"T\",\"remote_addr\":\"127.0.0.1\",\"remote_user\":\"\",~
                                \"method\":\"GET\",\"uri\":\"/valid\",\"protocol\":\"HTTP/1.1\",~
                                \"status\":200,\"bytes\":4,\"referer\":\"~A\",\"user_agent\":\"~A\"}"
                           (utf-8 "/ß") (utf-8 "ünï é 😀 \\\"q\\\" \\\\"))
                   (format nil "{\"time\":\"T\",\"remote_addr\":\"127.0.0.1\",\"remote_user\":\"\",~
                                \"method\":\"GET\",\"uri\":\"/invalid\",\"protocol\":\"HTTP/1.1\",~
                                \"status\":200,\"bytes\":4,\"referer\":\"\",\"user_agent\":~
                                \"a\\u00e9b \\u00c0\\u00af \\u00ed\\u00a0\\u0080 \\u0080 \\u00e2\\u0082 ~
                                \\u00f5\\u0080 \\u00f4\\u0090\\u0080\\u0080 z\"}")
                   (format nil "{\"time\":\"T\",\"remote_addr\":\"127.0.0.1\",\"remote_user\":\"\",~
                                \"method\":null,\"uri\":null,\"protocol\":null,~
                                \"request\":\"GET /~A\\u0001\\u007f HTTP/1.1\",~
                                \"status\":400,\"bytes\":16,\"referer\":\"\",\"user_agent\":\"\"}"
                           (utf-8 "ünï")))
                  #'string<)))
      (is (= 3 (length lines)) "~S" lines)
      (loop for line in lines
            for want in expected
            do (is (string= want line) "~S~%  expected ~S" line want)))
    (let ((output (uiop:run-program
                   (list "/usr/bin/python3" "-c"
                         "import json,sys
for line in open(sys.argv[1], encoding='utf-8', errors='strict'):
    o = json.loads(line)
    del o['time']
    print(ascii(sorted(o.items())))"
                         (namestring path))
                   :output :lines :error-output :string :ignore-error-status t)))
      (is (equal (sort (list "[('bytes', 4), ('method', 'GET'), ('protocol', 'HTTP/1.1'), ('referer', '/\\xdf'), ('remote_addr', '127.0.0.1'), ('remote_user', ''), ('status', 200), ('uri', '/valid'), ('user_agent', '\\xfcn\\xef \\xe9 \\U0001f600 \"q\" \\\\')]"
                             "[('bytes', 4), ('method', 'GET'), ('protocol', 'HTTP/1.1'), ('referer', ''), ('remote_addr', '127.0.0.1'), ('remote_user', ''), ('status', 200), ('uri', '/invalid'), ('user_agent', 'a\\xe9b \\xc0\\xaf \\xed\\xa0\\x80 \\x80 \\xe2\\x82 \\xf5\\x80 \\xf4\\x90\\x80\\x80 z')]"
                             "[('bytes', 16), ('method', None), ('protocol', None), ('referer', ''), ('remote_addr', '127.0.0.1'), ('remote_user', ''), ('request', 'GET /\\xfcn\\xef\\x01\\x7f HTTP/1.1'), ('status', 400), ('uri', None), ('user_agent', '')]")
                       #'string<)
                 (sort (copy-list output) #'string<))
          "~{~A~%~}" output))))

;;; The engine's own answers

(defparameter *refusal-settings*
  '(:header-timeout 1 :read-timeout 1 :handler-timeout 1 :max-request-line-bytes 200
    :max-head-bytes 1000 :max-body-bytes 100)
  "Limits that the requests of ENGINE-ANSWER-CASES pass, and timeouts of a
second.")

(defun engine-answer-cases ()
  "(REQUEST STATUS LOGGED AGENT): a request, as a string of octets, the
status it gets, its request as the combined log writes it, and its
User-Agent there.  An answer of the engine's own of each kind, the 503 of a
handler past its deadline, and a 200."
  (let ((long (format nil "GET /~A HTTP/1.1" (make-string 300 :initial-element #\a))))
    `((,(crlf "GET /ok HTTP/1.1" "Host: x" "User-Agent: ua" "Connection: close")
       200 "GET /ok HTTP/1.1" "ua")
      (,(crlf "GET /\"q\" HTTP/1.1" "Host: x" "User-Agent: ua" "Bad Header")
       400 "GET /\\x22q\\x22 HTTP/1.1" "-")
      (,(crlf "garbage") 400 "garbage" "-")
      (,(crlf long "Host: x") 414 ,long "-")
      (,(crlf "GET /big-head HTTP/1.1" "Host: x" (format nil "X-Big: ~A" (make-string 1200 :initial-element #\b)))
       431 "GET /big-head HTTP/1.1" "-")
      (,(crlf "POST /big-body HTTP/1.1" "Host: x" "Content-Length: 1000")
       413 "POST /big-body HTTP/1.1" "-")
      (,(crlf "GET /coded HTTP/1.1" "Host: x" "Transfer-Encoding: gzip") 501 "GET /coded HTTP/1.1" "-")
      (,(crlf "GET /two HTTP/2.0" "Host: x") 505 "GET /two HTTP/2.0" "-")
      ;; A head the engine accepted, whose chunked body is malformed: its
      ;; fields are known.
      (,(format nil "~Azz~C~C" (crlf "POST /chunks HTTP/1.1" "Host: x" "User-Agent: ua"
                                     "Transfer-Encoding: chunked")
                #\Return #\Linefeed)
       400 "POST /chunks HTTP/1.1" "ua")
      ;; Part of a head, then nothing until the header timeout.
      (,(format nil "GET /slow-head HTTP/1.1~C~CHost: x~C~C" #\Return #\Linefeed #\Return #\Linefeed)
       408 "GET /slow-head HTTP/1.1" "-")
      ;; Part of a body, then nothing until the read timeout.
      (,(format nil "~Aab" (crlf "POST /slow-body HTTP/1.1" "Host: x" "User-Agent: ua"
                                 "Content-Length: 10"))
       408 "POST /slow-body HTTP/1.1" "ua")
      (,(crlf "GET /log-sleep HTTP/1.1" "Host: x") 503 "GET /log-sleep HTTP/1.1" "-"))))

(defun check-engine-answers-logged (kind)
  (let ((path (merge-pathnames (format nil "refusals-~(~A~).log" kind) (run-directory)))
        (expected '()))
    (call-with-logged-front-end
     kind path *refusal-settings*
     (lambda (port server)
       (loop for (request status logged agent) in (engine-answer-cases)
             do (let ((answer (exchange-raw port request)))
                  (if (and (wire-response-p answer) (= status (wire-status answer)))
                      (push (format nil "127.0.0.1 - - [T] \"~A\" ~D ~D \"-\" \"~A\""
                                    logged status (length (wire-body answer)) agent)
                            expected)
                      (fail "~(~A~): ~S got ~A, not ~D" kind (subseq request 0 (min 40 (length request)))
                            answer status))))
       ;; A line the housekeeper wrote (a 408) goes through a worker, or
       ;; the native log's thread: all of them are written before the stop.
       (is (wait-until (lambda () (= (length (engine-answer-cases))
                                     (length (ignore-errors (log-lines path)))))))
       (is (eql 0 (getf (gallop:stats server) :access-log-dropped)))))
    (let ((lines (sorted-lines path))
          (expected (sort expected #'string<)))
      (is (= (length (engine-answer-cases)) (length lines)) "~(~A~): ~D lines~%~{  ~A~%~}"
          kind (length lines) lines)
      (is (equal expected lines) "~(~A~):~%~{  ~A~%~}expected~%~{  ~A~%~}" kind lines expected))))

(test every-answer-of-the-engines-own-is-logged-native
  "Each answer GALLOP:START's engine writes itself (400 for a bad head, 414,
431, 413, 501, 505, 400 for a bad body, 408 for a slow head and a slow
body) and the 503 of a handler past its deadline gets one line, as nginx
logs its own: the request line as received (escaped), the status, the
octets of body sent; the User-Agent of a head the engine had accepted."
  (check-engine-answers-logged :native))

(test every-answer-of-the-engines-own-is-logged-acceptor
  "The same on a GALLOP:ACCEPTOR: the engine's answers, which Hunchentoot
never sees, reach its access log beside the lines of its own answers."
  (check-engine-answers-logged :acceptor))

(defun check-overload-logged (kind)
  "One worker, blocked, and a queue of one, full: a new connection gets 503
at once, and the log has its line (its request was never read: \"-\"),
besides the lines of the two requests served."
  (let ((path (merge-pathnames (format nil "overload-~(~A~).log" kind) (run-directory))))
    (with-globals ((*wire-entered* (sb-thread:make-semaphore))
                   (*wire-release* (sb-thread:make-semaphore)))
      (call-with-logged-front-end
       kind path '(:max-thread-count 1 :standby-thread-count 1 :max-queue-length 1)
       (lambda (port server)
         (let ((busy (connect port))
               (queued nil))
           (unwind-protect
                (progn
                  (send busy (crlf "GET /wire-block HTTP/1.1" "Host: x"))
                  (is (sb-thread:wait-on-semaphore *wire-entered* :timeout 10))
                  (setf queued (connect port))
                  (send queued (crlf "GET /wire-ok HTTP/1.1" "Host: x"))
                  (is (wait-until (lambda () (eql 1 (getf (gallop:stats server) :pending)))))
                  (let ((answer (raw-exchange port (crlf "GET /shed HTTP/1.1" "Host: x"))))
                    (is (and (wire-response-p answer) (= 503 (wire-status answer))) "~A" answer))
                  (sb-thread:signal-semaphore *wire-release*)
                  (is (exact-answer-p (read-wire-or-error busy) "Hey!"))
                  (is (exact-answer-p (read-wire-or-error queued) "Hey!"))
                  ;; The 503's line, written by a worker (or the native
                  ;; log's thread) after the housekeeper's answer.
                  (is (wait-until (lambda () (= 3 (length (ignore-errors (log-lines path))))))))
             (sb-thread:signal-semaphore *wire-release* 10)
             (when queued (usocket:socket-close queued))
             (usocket:socket-close busy))))))
    (is (equal (sort (list "127.0.0.1 - - [T] \"GET /wire-block HTTP/1.1\" 200 4 \"-\" \"-\""
                           "127.0.0.1 - - [T] \"GET /wire-ok HTTP/1.1\" 200 4 \"-\" \"-\""
                           "127.0.0.1 - - [T] \"-\" 503 24 \"-\" \"-\"")
                     #'string<)
               (sorted-lines path))
        "~(~A~): ~S" kind (sorted-lines path))))

(test an-overload-503-is-logged-native (check-overload-logged :native))
(test an-overload-503-is-logged-acceptor (check-overload-logged :acceptor))

(test engine-answers-take-hunchentoots-layout-where-its-lines-are-kept
  "On a GALLOP:ACCEPTOR with :ACCESS-LOG-FORMAT :HUNCHENTOOT, and on a stock
acceptor given a GALLOP:TASKMASTER, an answer of the engine's own gets a
line in the layout of Hunchentoot's (its local time, no ident), its
request line as received escaped as nginx escapes it."
  (flet ((check (what lines)
           (is (= 1 (length lines)) "~A: ~S" what lines)
           (is (cl-ppcre:scan "^127\\.0\\.0\\.1 - \\[\\d{4}-\\d\\d-\\d\\d \\d\\d:\\d\\d:\\d\\d\\] \"GET /\\\\x22q\\\\x22 HTTP/1\\.1\" 400 16 \"-\" \"-\"$"
                              (first lines))
               "~A: ~S" what lines)))
    (let ((path (merge-pathnames "refusal-hunchentoot.log" (run-directory)))
          (request (crlf "GET /\"q\" HTTP/1.1" "Host: x" "Bad Header")))
      (call-with-logged-front-end :acceptor path '()
                                  (lambda (port server)
                                    (declare (ignore server))
                                    (exchange-raw port request))
                                  :format :hunchentoot)
      (check "gallop:acceptor" (log-lines path))
      (when (probe-file path) (delete-file path))
      (with-server (server 'hunchentoot:easy-acceptor :access-log-destination path
                                                      :taskmaster (make-instance 'gallop:taskmaster))
        (exchange-raw (port-of server) request))
      (check "stock acceptor" (log-lines path)))))

;;; A storm of the engine's own answers: the lines waiting for the disk are
;;; bounded, made only when kept, and each is written or counted.

(defun answers-from-clients (port requests clients)
  "Send each of REQUESTS (strings) on a connection of its own, from CLIENTS
threads at once, each reading its answer to the close; the answers, in the
order of REQUESTS (a WIRE-ERROR for an answer that did not come whole, or
no close within 5 s).  NIL for a request whose thread did not end in 20 s."
  (let* ((answers (make-array (length requests) :initial-element nil))
         (threads (loop for k below clients
                        collect (let ((k k))
                                  (sb-thread:make-thread
                                   (lambda ()
                                     (loop for i from k below (length requests) by clients
                                           do (setf (aref answers i)
                                                    (exchange-raw port (nth i requests))))))))))
    (dolist (thread threads)
      (sb-thread:join-thread thread :default nil :timeout 20))
    (coerce answers 'list)))

(defun statuses (answers)
  (mapcar (lambda (a) (if (wire-response-p a) (wire-status a) a)) answers))

(test a-storm-of-bad-heads-holds-few-lines-and-never-waits-on-the-file
  "A GALLOP:ACCEPTOR whose access log cannot be written (Hunchentoot's
access-log lock held by the test) gets 40 bad heads from 4 clients at
once: every client gets its 400 and its close at once (no worker waits on
the file), the taskmaster holds the first 8 lines (its bound, made small
here), each at its length, and drops the other 32 without making them,
counted.  Once the lock is free those 8 lines are written, no more: written
+ dropped = sent."
  (let ((path (merge-pathnames "storm-acceptor.log" (run-directory)))
        (n 40)
        (bound 8)
        (made (list 0))
        (held nil))
    (sb-int:encapsulate 'gallop::fill-log-line 'count
                        (lambda (function &rest arguments)
                          (sb-ext:atomic-incf (car made))
                          (apply function arguments)))
    (unwind-protect
         (with-globals ((gallop::*answer-log-max-lines* bound))
           (call-with-logged-front-end
            :acceptor path '()
            (lambda (port server)
              (let ((requests (loop for i below n
                                    collect (crlf (format nil "GET /bad-~3,'0D HTTP/1.1" i)
                                                  "Host: x" "Bad Header")))
                    (answers nil)
                    (lock (gallop::hunchentoot-access-log-lock)))
                (bt:acquire-lock lock)
                (unwind-protect
                     (progn
                       (setf answers (answers-from-clients port requests 4))
                       (is (equal (make-list n :initial-element 400) (statuses answers))
                           "~S" (statuses answers))
                       (is (eql (- n bound) (stat server :access-log-dropped)))
                       (is (= bound (car made)) "~D lines made" (car made))
                       (let ((log (gallop::taskmaster-answer-log
                                   (gallop::acceptor-gallop-taskmaster server))))
                         (is (= bound (gallop::answer-log-waiting log)))
                         (setf held (gallop::answer-log-octets log))))
                  (bt:release-lock lock))
                (is (wait-until (lambda () (= bound (length (ignore-errors (log-lines path)))))))
                (let ((log (gallop::taskmaster-answer-log (gallop::acceptor-gallop-taskmaster server))))
                  (is (wait-until (lambda () (zerop (gallop::answer-log-waiting log)))))
                  (is (zerop (gallop::answer-log-octets log))))
                (is (eql (- n bound) (stat server :access-log-dropped)))
                (is (= bound (car made))))))
           ;; What the taskmaster held is what it wrote: the lines at their
           ;; length, not the buffers they were made in.
           (let ((lines (log-lines path)))
             (is (= bound (length lines)) "~S" lines)
             (is (eql held (with-open-file (in path :element-type '(unsigned-byte 8))
                             (file-length in))))
             (is (= bound (length (remove-duplicates lines :test #'string=))))
             (dolist (line lines)
               (is (cl-ppcre:scan "^127\\.0\\.0\\.1 - - \\[T\\] \"GET /bad-0[0-3]\\d HTTP/1\\.1\" 400 16 \"-\" \"-\"$"
                                  (without-time line))
                   "~S" line))))
      (sb-int:unencapsulate 'gallop::fill-log-line 'count))))

(defclass gated-octet-stream (sb-gray:fundamental-binary-output-stream)
  ((gate :initform (sb-thread:make-semaphore) :reader gate
         :documentation "Signalled once: the first write waits for it.")
   (open :initform nil)
   (octets :initform (make-array 0 :element-type '(unsigned-byte 8) :adjustable t
                                   :fill-pointer 0)
           :reader gated-octets))
  (:documentation "A binary stream whose first write waits until its GATE
is signalled (a disk that stalls), then keeps what it is given."))

(defmethod stream-element-type ((stream gated-octet-stream))
  '(unsigned-byte 8))

(defmethod sb-gray:stream-write-sequence ((stream gated-octet-stream) sequence
                                          &optional (start 0) end)
  (with-slots (gate open octets) stream
    (unless open
      (sb-thread:wait-on-semaphore gate :timeout 30)
      (setf open t))
    (loop for i from start below (or end (length sequence))
          do (vector-push-extend (elt sequence i) octets))
    sequence))

(test a-storm-of-long-bad-heads-makes-only-the-lines-the-queue-keeps-native
  "The native access log, its disk stalled (a stream whose first write
waits) and its queue's bound made 16 KiB, gets 40 bad heads of 2 KiB
(their lines too long for a worker's scratch, so they go to the queue),
from 4 clients at once: each gets its 400; the lines made are exactly the
lines the log writes, the others dropped before they are made, and
counted: made + dropped = sent; the queue held no more than its bound and a
line."
  (let ((n 40)
        (bound 16384)
        (made (list 0))
        (out (make-instance 'gated-octet-stream))
        (dropped nil))
    (sb-int:encapsulate 'gallop::fill-log-line 'count
                        (lambda (function &rest arguments)
                          (sb-ext:atomic-incf (car made))
                          (apply function arguments)))
    (unwind-protect
         (with-globals ((gallop::*access-log-max-queued-bytes* bound))
           (let* ((server (gallop:start #'hey-app :address "127.0.0.1" :port 0
                                                  :log (message-log-destination) :access-log out))
                  (log (gallop::server-access-log server))
                  (long (make-string 2000 :initial-element #\a)))
             (unwind-protect
                  (let ((answers (answers-from-clients
                                  (gallop:server-port server)
                                  (loop for i below n
                                        collect (crlf (format nil "GET /~A-~3,'0D HTTP/1.1" long i)
                                                      "Host: x" "Bad Header"))
                                  4)))
                    (is (equal (make-list n :initial-element 400) (statuses answers))
                        "~S" (statuses answers))
                    (setf dropped (stat server :access-log-dropped))
                    (is (plusp dropped))
                    (is (= n (+ (car made) dropped)) "~D made, ~D dropped" (car made) dropped)
                    (is (< (gallop::access-log-queued-bytes log) (+ bound 2100))
                        "~D octets queued" (gallop::access-log-queued-bytes log)))
               (sb-thread:signal-semaphore (gate out))
               (gallop:stop server))))
      (sb-int:unencapsulate 'gallop::fill-log-line 'count))
    (let ((lines (uiop:split-string (string-right-trim '(#\Newline)
                                                       (map 'string #'code-char (gated-octets out)))
                                    :separator '(#\Newline))))
      (is (= (car made) (length lines)) "~D made, ~D written" (car made) (length lines))
      (is (= n (+ (length lines) dropped)))
      (is (= (length lines) (length (remove-duplicates lines :test #'string=))))
      (is (every (lambda (line) (search "HTTP/1.1\" 400 16 \"-\" \"-\"" line)) lines)))))

(defun check-lines-past-the-pool (submit more)
  "On a GALLOP:ACCEPTOR, six clients each send part of a head, and get 408
from the housekeeper, whose lines go to a writer handed to the pool
through GALLOP.CORE:POOL-SUBMIT, here SUBMIT instead (called with the
original, the pool and the thunk).  Then, when MORE, one bad head (its
400 from a worker, POOL-SUBMIT back).  The lines written before the stop,
and after it, and the lines dropped."
  (let ((path (merge-pathnames "past-the-pool.log" (run-directory)))
        (before nil)
        (dropped nil)
        (bytes nil))
    (sb-int:encapsulate 'gallop.core:pool-submit 'past-the-pool submit)
    (unwind-protect
         (call-with-logged-front-end
          :acceptor path '(:header-timeout 1)
          (lambda (port server)
            (let ((answers (answers-from-clients
                            port (loop for i below 6
                                       collect (format nil "GET /slow-~D HTTP/1.1~C~CHost: x~C~C"
                                                       i #\Return #\Linefeed #\Return #\Linefeed))
                            6)))
              (is (equal (make-list 6 :initial-element 408) (statuses answers))
                  "~S" (statuses answers))
              (when (wire-response-p (first answers))
                (setf bytes (length (wire-body (first answers))))))
            (sb-int:unencapsulate 'gallop.core:pool-submit 'past-the-pool)
            (when more
              (is (eql 400 (first (statuses (list (exchange-raw port (crlf "GET /bad HTTP/1.1" "Host: x"
                                                                           "Bad Header")))))))
              (wait-until (lambda () (= 7 (length (ignore-errors (log-lines path)))))
                          :timeout 5))
            (setf before (ignore-errors (log-lines path))
                  dropped (stat server :access-log-dropped))))
      (sb-int:unencapsulate 'gallop.core:pool-submit 'past-the-pool))
    (values (mapcar #'without-time before) (sorted-lines path) dropped bytes)))

(defun slow-head-lines (bytes &optional more)
  "The lines of CHECK-LINES-PAST-THE-POOL's answers, sorted: its 408s
having BYTES of body."
  (sort (append (loop for i below 6
                      collect (format nil "127.0.0.1 - - [T] \"GET /slow-~D HTTP/1.1\" 408 ~D \"-\" \"-\""
                                      i bytes))
                (and more (list "127.0.0.1 - - [T] \"GET /bad HTTP/1.1\" 400 16 \"-\" \"-\"")))
        #'string<))

(test engine-answer-lines-whose-writer-the-pool-never-ran-are-written-at-the-stop
  "The housekeeper's six 408s, their writer handed to a pool that never
runs it (as one that stops first): the lines wait, and the stop writes
them, none dropped."
  (let ((submitted (list 0)))
    (multiple-value-bind (before after dropped bytes)
        (check-lines-past-the-pool (lambda (function pool thunk)
                                     (declare (ignore function pool thunk))
                                     (sb-ext:atomic-incf (car submitted))
                                     nil)
                                   nil)
      (is (plusp (car submitted)))
      (is (null before) "~S" before)
      (is (eql 0 dropped))
      (is (equal (slow-head-lines bytes) after) "~S" after))))

(test engine-answer-lines-the-pool-refused-are-written-by-the-next-writer
  "The housekeeper's six 408s, the pool refusing their writer (an error):
the lines wait, and the writer of the next line, a worker's 400, writes
them with it, none dropped."
  (multiple-value-bind (before after dropped bytes)
      (check-lines-past-the-pool (lambda (function pool thunk)
                                   (declare (ignore function pool thunk))
                                   (error "The pool refuses."))
                                 t)
    (is (eql 0 dropped))
    (is (equal (slow-head-lines bytes t) (sort (copy-list before) #'string<)) "~S" before)
    (is (equal (slow-head-lines bytes t) after) "~S" after)))
